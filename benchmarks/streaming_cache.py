"""Streaming-cache write cost: time and bytes per evicting append and per rewrite, roll vs ring vs minimum.

Eager ``update_and_get_attention_kv`` of ``CausalKVCache`` (roll layout: rows after the sink move down on eviction)
and of ``RingCausalKVCache`` (ring layout: rows after the sink form a ring, an evicting append writes the chunk only)
against the minimum data movement: copying the chunk's K and V into preallocated rows (``copy_``, same dtype, same
buffers' geometry). All three are measured in the same run, interleaved (benchmarks/_harness.py's rotated order: each
rep is a round of one call per candidate; a call changes the cache, so no batching of calls), one thread by default,
wall time; ratios are per-rep ``candidate / minimum`` (and ``ring / roll``), printed median [p25-p75] as every
benchmark's figures. No targets: the verdict block says what the run found.

Geometry (docs/models.md): Wan-2.1 1.3B (12 KV heads x 128) and LingBot-world (40 x 128), scaled for CPU: 64 tokens per
frame (1560 at 480x832), chunks of 3 frames, a window of 21 frames (the cache size), sink 0 (Wan) / 3 frames
(LingBot), bf16. K/V are synthetic (standard normal, cast to bf16).

Bytes written per call are counted from the rows each layout writes: the roll layout's evicting append writes the
chunk plus the moved rows twice (``kvops.cache_roll`` stages overlapping rows through a clone, then copies them back);
the ring layout's writes the chunk only (checked here by diffing the ring buffer before/after every call); a rewrite
writes the chunk in both.

    python benchmarks/streaming_cache.py --threads 1 --reps 30
    python benchmarks/streaming_cache.py --quick       # 8 tokens per frame, 5 reps
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402  (no torch: --help answers at once)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--reps", type=int, default=30, help="interleaved repetitions per case")
    p.add_argument("--tokens-per-frame", type=int, default=64, help="tokens per video frame (1560 at 480x832)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="cache dtype")
    p.add_argument("--quick", action="store_true", help="8 tokens per frame and 5 reps")
    harness.add_json_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.tokens_per_frame, args.reps = 8, 5
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch  # noqa: E402

from kvops import CausalKVCache, RingCausalKVCache  # noqa: E402

GEOMETRIES = {  # name: (KV heads, head_dim, sink frames)
    "wan2.1-1.3b": (12, 128, 0),
    "lingbot-world": (40, 128, 3),
}


def changed_rows(before: torch.Tensor, after: torch.Tensor) -> int:
    """Rows ``[B, S, 2, H, D]`` of the fused K/V buffer whose bytes changed."""
    return int((before.view(torch.int16) != after.view(torch.int16)).flatten(2).any(-1).sum())


def bench(heads, dim, sink_frames, tpf, chunk_frames, window_frames, reps, dtype):
    n, size, sink = chunk_frames * tpf, window_frames * tpf, sink_frames * tpf
    caches = {cls: cls.allocate(1, size, heads, dim, dtype=dtype, fused_kv=True, sink_tokens=sink)
              for cls in (CausalKVCache, RingCausalKVCache)}
    g = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(1, n, heads, dim, generator=g).to(dtype), torch.randn(1, n, heads, dim, generator=g).to(dtype))
              for _ in range(4)]
    probe = tuple(torch.randn(1, n, heads, dim, generator=g).to(dtype) for _ in range(2))  # rep 0: rows never seen
    s = 0
    while s + n <= size:  # fill the window: the next append evicts
        for cache in caches.values():
            cache.update_and_get_attention_kv(*chunks[0], s)
        s += n
    kv_min = torch.empty(1, size, 2, heads, dim, dtype=dtype)
    k_min, v_min = kv_min[:, :, 0], kv_min[:, :, 1]

    def minimum(key, value, start):
        k_min[:, size - n :].copy_(key)
        v_min[:, size - n :].copy_(value)

    ring_kv = caches[RingCausalKVCache].k._base  # the fused [B, S, 2, H, D] allocation
    candidates = {
        "roll": caches[CausalKVCache].update_and_get_attention_kv,
        "ring": caches[RingCausalKVCache].update_and_get_attention_kv,
        "min": minimum,
    }
    row_bytes = heads * dim * torch.finfo(dtype).bits // 8
    out = {}
    for kind in ("evicting append", "rewrite"):
        times = {name: [] for name in candidates}
        ring_rows = []
        for i in range(reps):
            key, value = probe if i == 0 else chunks[i % len(chunks)]
            start = s if kind == "evicting append" else s - n
            for name in harness.rotation(list(candidates), i):  # interleaved, no fixed first/last
                before = ring_kv.clone() if name == "ring" and i == 0 else None
                t0 = time.perf_counter()
                candidates[name](key, value, start)
                times[name].append(time.perf_counter() - t0)
                if before is not None:
                    ring_rows.append(changed_rows(before, ring_kv))
            if kind == "evicting append":
                s += n
        moved = size - n - sink if kind == "evicting append" else 0  # rows after the sink that move down
        chunk_bytes = 2 * n * row_bytes
        res = {
            "bytes roll": 2 * (n + 2 * moved) * row_bytes / chunk_bytes,
            "bytes ring": 2 * max(ring_rows) * row_bytes / chunk_bytes,  # measured: rows that changed (<= n)
            "roll/min": harness.ratio(times["roll"], times["min"]),
            "ring/min": harness.ratio(times["ring"], times["min"]),
            "ring/roll": harness.ratio(times["ring"], times["roll"]),
            "ms": {name: harness.Spread.of(t).scaled(1e3).median for name, t in times.items()},
        }
        out[kind] = res
    return out


def main(args) -> None:
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    report = harness.Report("streaming_cache", args)
    report.start(threads=args.threads)
    report.note(f"{args.dtype}, {args.tokens_per_frame} tokens/frame, chunk 3 frames, window 21 frames, {args.reps} "
                "interleaved reps (roll, ring, minimum), wall clock; bytes: K+V bytes written per call / the chunk's "
                "K+V bytes; ratios: per rep")
    table = report.table("streaming-cache writes: roll (CausalKVCache) and ring (RingCausalKVCache) vs the minimum copy",
                         [("geometry", 13), ("call", 15), ("B roll", 6, "{:.2f}"), ("B ring", 6, "{:.2f}"),
                          ("roll/min", 17), ("ring/min", 17), ("ring/roll", 17), ("min ms", 6, "{:.3f}")])
    for name, (heads, dim, sink_f) in GEOMETRIES.items():
        res = bench(heads, dim, sink_f, args.tokens_per_frame, 3, 21, args.reps, dtype)
        for kind, r in res.items():
            table.row(name, kind, r["bytes roll"], r["bytes ring"], r["roll/min"], r["ring/min"], r["ring/roll"],
                      r["ms"]["min"], ms=r["ms"])
            if kind == "evicting append":
                report.finding(f"{name}: an evicting append on the ring layout writes {r['bytes ring']:.2f}x the "
                               f"chunk's bytes (roll: {r['bytes roll']:.2f}x); time ring/roll {r['ring/roll']}")
    report.finish()


if __name__ == "__main__":
    main(ARGS)

"""Streaming-cache write cost: time and bytes per evicting append and per rewrite, against the minimum (issue 12 §3).

Eager ``CausalKVCache.update_and_get_attention_kv`` in its roll layout (rows after the sink move down on eviction)
against the minimum data movement: copying the chunk's K and V into preallocated rows (``copy_``, same dtype, same
buffers' geometry). Both are measured in the same run, interleaved (roll, minimum, roll, ...), one thread by default;
ratios are per-rep ``roll / minimum`` with median and interquartile range.

Geometry (docs/models.md): Wan-2.1 1.3B (12 KV heads x 128) and LingBot-world (40 x 128), scaled for CPU: 64 tokens per
frame (1560 at 480x832), chunks of 3 frames, a window of 21 frames (the cache size), sink 0 (Wan) / 3 frames
(LingBot), bf16. K/V are synthetic (standard normal, cast to bf16).

Bytes written per call are counted from the rows the layout moves: an evicting append writes the chunk plus the
moved rows twice (``kvops.cache_roll`` stages overlapping rows through a clone, then copies them back); a rewrite
writes the chunk only. The ring layout of issue 12 §3 is not implemented yet; this prints the baseline it must beat.

    python benchmarks/streaming_cache.py --threads 1 --reps 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvops import CausalKVCache

GEOMETRIES = {  # name: (KV heads, head_dim, sink frames)
    "wan2.1-1.3b": (12, 128, 0),
    "lingbot-world": (40, 128, 3),
}


def quartiles(xs):
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def bench(heads, dim, sink_frames, tpf, chunk_frames, window_frames, reps, dtype):
    n, size, sink = chunk_frames * tpf, window_frames * tpf, sink_frames * tpf
    cache = CausalKVCache.allocate(1, size, heads, dim, dtype=dtype, fused_kv=True, sink_tokens=sink)
    g = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(1, n, heads, dim, generator=g).to(dtype), torch.randn(1, n, heads, dim, generator=g).to(dtype))
              for _ in range(4)]
    s = 0
    while s + n <= size:  # fill the window: the next append evicts
        cache.update_and_get_attention_kv(*chunks[0], s)
        s += n
    kv_min = torch.empty(1, size, 2, heads, dim, dtype=dtype)
    k_min, v_min = kv_min[:, :, 0], kv_min[:, :, 1]

    def minimum(key, value):
        k_min[:, size - n :].copy_(key)
        v_min[:, size - n :].copy_(value)

    row_bytes = heads * dim * torch.finfo(dtype).bits // 8
    out = {}
    for kind in ("evicting append", "rewrite"):
        ratios, t_roll, t_min = [], [], []
        for i in range(reps):
            key, value = chunks[i % len(chunks)]
            start = s if kind == "evicting append" else s - n
            t0 = time.perf_counter()
            cache.update_and_get_attention_kv(key, value, start)
            t1 = time.perf_counter()
            minimum(key, value)
            t2 = time.perf_counter()
            if kind == "evicting append":
                s += n
            ratios.append((t1 - t0) / (t2 - t1))
            t_roll.append(t1 - t0)
            t_min.append(t2 - t1)
        moved = size - n - sink if kind == "evicting append" else 0  # rows after the sink that move down
        bytes_roll = 2 * (n + 2 * moved) * row_bytes
        bytes_min = 2 * n * row_bytes
        out[kind] = (quartiles(ratios), statistics.median(t_roll), statistics.median(t_min), bytes_roll, bytes_min)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--tokens-per-frame", type=int, default=64, help="1560 at 480x832")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.dtype}, {args.tokens_per_frame} tokens/frame, "
          f"chunk 3 frames, window 21 frames, {args.reps} interleaved reps; layout: roll")
    print(f"{'geometry':<15} {'call':<16} {'bytes/min':>9} {'time/min median [q1, q3]':>26} {'roll ms':>8} {'min ms':>7}")
    for name, (heads, dim, sink_f) in GEOMETRIES.items():
        res = bench(heads, dim, sink_f, args.tokens_per_frame, 3, 21, args.reps, dtype)
        for kind, ((q1, med, q3), t_roll, t_min, b_roll, b_min) in res.items():
            print(f"{name:<15} {kind:<16} {b_roll / b_min:>9.2f} {med:>12.2f} [{q1:.2f}, {q3:.2f}]{'':>4} "
                  f"{1e3 * t_roll:>8.3f} {1e3 * t_min:>7.3f}")


if __name__ == "__main__":
    main()

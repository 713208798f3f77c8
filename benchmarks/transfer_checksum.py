"""Cost of the optional payload checksum of the KV transfer (``checksum=True``, docs/transfer.md), on CPU.

Geometry: one prefill/decode rank pair of Llama-3.2-1B (8 KV heads x head_dim 64, docs/models.md) served at TP 4 -> TP 4
(2 KV heads per rank, one writer per decode rank), 16 layers, bfloat16, block_size 16, one request of ``--tokens``
tokens split at a staging grid of ``--chunk`` tokens. Synthetic ``randn`` KV. Two tables, each ratio the median
[p25-p75] of per-round ratios (a candidate over its baseline *in the same round*; rounds interleave the candidates in
rotated order, so machine noise hits all alike: benchmarks/_harness.py, as every benchmark). Nothing is asserted; the
verdict block at the end says what the run found.

* **local** (one process, one thread, ``time.thread_time``): per message, ``wire.checksum`` (the CRC-32 of the
  payload, computed once by the sender and once by the receiver; with the optional ``isal`` package its folding CRC,
  and the standard library's ``zlib.crc32`` measured beside it) vs the gather of the same bytes
  (``kvops.paged_kv_gather``, which the transfer does anyway) and vs a plain copy of the message (``Tensor.copy_``):
  the cost per GB in milliseconds and as a ratio to the copy measured in the same rounds; the header names the
  CPU's vector ISA.
* **transfer** (2 processes, gloo over loopback, wall clock): ``KVSender.send`` + ``KVReceiver.receive`` of the
  request with ``checksum=True`` vs the same with ``checksum=False`` (both with the per-request metadata step and end
  markers), and the plain transfer vs one raw gloo message of the same bytes.

    python benchmarks/transfer_checksum.py [--rounds 15] [--tokens 2048] [--chunk 512] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import socket
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402  (no torch: --help answers at once)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds per table row")
    p.add_argument("--inner", type=int, default=5, help="calls per candidate per round (local table)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the one request transferred")
    p.add_argument("--chunk", type=int, default=512, help="staging grid in tokens (the request is split at it)")
    p.add_argument("--quick", action="store_true", help="5 rounds, 256 tokens, grid 128 (options given explicitly "
                                                        "still apply)")
    harness.add_json_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        given = set(argv if argv is not None else sys.argv[1:])
        for flag, key, value in (("--rounds", "rounds", 5), ("--tokens", "tokens", 256), ("--chunk", "chunk", 128)):
            if flag not in given:
                setattr(args, key, value)
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch  # noqa: E402

LAYERS, H_LOCAL, HEAD_DIM, BLOCK, DTYPE = 16, 2, 64, 16, torch.bfloat16


def caches(num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda: torch.randn(num_blocks, BLOCK, H_LOCAL, HEAD_DIM, generator=g).to(DTYPE)  # noqa: E731
    return [make() for _ in range(LAYERS)], [make() for _ in range(LAYERS)]


def local(report, args):
    import kvops
    from kvops.ops.transfer import staging_shape
    from kvops.transfer import wire

    torch.set_num_threads(1)
    n = args.chunk
    ks, vs = caches(-(-n // BLOCK) + 4)
    table = torch.randperm(ks[0].shape[0])[: -(-n // BLOCK)].to(torch.int32)
    payload = 2 * LAYERS * n * H_LOCAL * HEAD_DIM * DTYPE.itemsize
    msg = torch.empty(wire.message_bytes(payload), dtype=torch.uint8)
    staging = wire.split(msg, payload, DTYPE, staging_shape(LAYERS, n, H_LOCAL, HEAD_DIM))[0]
    other = torch.empty_like(msg)
    kvops.paged_kv_gather(ks, vs, table, staging)
    import zlib

    view = memoryview(msg[: wire.padded(payload)].numpy())
    candidates = {"gather": lambda: kvops.paged_kv_gather(ks, vs, table, staging),
                  "copy": lambda: other.copy_(msg),
                  "checksum": lambda: wire.checksum(msg, payload),
                  "zlib.crc32": lambda: zlib.crc32(view)}
    t = harness.interleave(candidates, args.rounds, clock="thread", reps=args.inner)
    impl = "zlib.crc32" if wire._crc32 is zlib.crc32 else f"{wire._crc32.__module__}.crc32"
    report.print(f"local: one message of {n} tokens x {LAYERS} layers x {H_LOCAL} heads x {HEAD_DIM} "
                 f"({payload / 1e6:.2f} MB), {args.rounds} rounds x {args.inner} calls, 1 thread, thread CPU time; "
                 f"{isa()}")
    table = report.table("local: per message", [("candidate", 32), ("GB/s", 6, "{:.2f}"), ("ms per GB", 9, "{:.1f}"),
                                                ("/ copy", 17), ("/ gather", 17)])
    for name in ("copy", "gather", "checksum", "zlib.crc32"):
        label = f"checksum ({impl})" if name == "checksum" else name
        med = t.time(name).median
        table.row(label, payload / med / 1e9, med / payload * 1e9 * 1e3, t.ratio(name, "copy") if name != "copy"
                  else None, t.ratio(name, "gather") if name not in ("copy", "gather") else None)
    report.finding(f"the checksum ({impl}) costs {t.ratio('checksum', 'copy')} x a copy of the message, "
                   f"{t.ratio('checksum', 'gather')} x the gather the transfer does anyway")


def isa() -> str:
    """torch's vector ISA and the CPU flags a CRC folds with."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    crc = [x for x in ("sse4_2", "pclmulqdq", "vpclmulqdq", "avx512f") if x in flags]
    return f"ISA {torch.backends.cpu.get_cpu_capability()}, CPU flags {' '.join(crc) or 'unknown'}"


def worker(rank, port, args, out):
    import torch.distributed as dist

    from kvops.cache import PagedKVCache
    from kvops.transfer import KVReceiver, KVSender, TransferGroups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    groups = TransferGroups((0,), (1,))
    kw = dict(chunked_prefill_size=args.chunk, timeout_s=120)
    nbytes = 2 * LAYERS * args.tokens * H_LOCAL * HEAD_DIM * DTYPE.itemsize
    raw = torch.empty(nbytes, dtype=torch.uint8)
    if rank == 0:
        ks, vs = caches(-(-args.tokens // BLOCK) + 4)
        table = torch.randperm(ks[0].shape[0])[: -(-args.tokens // BLOCK)].to(torch.int32)
        ends = {c: KVSender(groups, 0, ks, vs, H_LOCAL, checksum=c, **kw) for c in (False, True)}
    else:
        cache = PagedKVCache(-(-args.tokens // BLOCK) + 4, BLOCK, H_LOCAL, HEAD_DIM, num_layers=LAYERS, dtype=DTYPE)
        ends = {c: KVReceiver(groups, 0, cache, H_LOCAL, checksum=c, **kw) for c in (False, True)}
    for end in ends.values():
        end.connect()
    times = {"plain": [], "checksum": [], "raw": []}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name in harness.rotation(list(times), r):  # the same order on both ranks
            dist.barrier()
            t0 = time.perf_counter()
            if name == "raw":
                (dist.send if rank == 0 else dist.recv)(raw, 1 - rank)
            elif rank == 0:
                ends[name == "checksum"].send(r * 10 + len(name), args.tokens, table)
            else:
                ends[name == "checksum"].receive(r * 10 + len(name), args.tokens)
                cache.free(r * 10 + len(name))
            if r:
                times[name].append(time.perf_counter() - t0)
    if rank == 1:
        out.put((times, nbytes))
    dist.destroy_process_group()


def transfer(report, args):
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["kvops"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    times, nbytes = out.get(timeout=600)
    for p in procs:
        p.join(60)
    plain, ck, raw = times["plain"], times["checksum"], times["raw"]
    report.print(f"\ntransfer of one request: {args.tokens} tokens ({nbytes / 1e6:.2f} MB), grid {args.chunk} tokens, "
                 f"1 -> 1 rank, gloo loopback, {args.rounds} rounds, wall clock (decode side, after a barrier)")
    table = report.table("transfer: send + receive of the request", [("candidate", 14), ("ms", 20, "{:.2f}"),
                                                                     ("GB/s", 6, "{:.2f}"), ("ratio", 17),
                                                                     ("ratio of", 16, None, "<")])
    ms = {name: harness.Spread.of(ts).scaled(1e3) for name, ts in times.items()}
    table.row("plain", ms["plain"], nbytes / (ms["plain"].median * 1e-3) / 1e9, harness.ratio(plain, raw),
              "plain / raw")
    table.row("checksum", ms["checksum"], nbytes / (ms["checksum"].median * 1e-3) / 1e9, harness.ratio(ck, plain),
              "checksum / plain")
    table.row("raw message", ms["raw"], nbytes / (ms["raw"].median * 1e-3) / 1e9, None, "-")
    report.finding(f"checksum=True makes a transfer take {harness.ratio(ck, plain)} x the time without it")


def main(args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = harness.Report("transfer_checksum", args)
    report.start(threads=1)
    local(report, args)
    transfer(report, args)
    report.finish()


if __name__ == "__main__":
    main(ARGS)

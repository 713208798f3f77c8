"""Parts of ``benchmarks/paged_decode.py``'s output besides its per-row tables (a helper module, not a benchmark).

* **Host figures** (per thread count): the copy bandwidth (``copy_bandwidth_gbs``: read + write bytes per second of
  a 256 MiB tensor copy) and the FMA rates (``fma_gflops``: a ``torch.mm`` big enough to be compute bound, GFLOP/s,
  in fp32 and in bf16), all measured in the same run as the rows they bound.
* **Bounds of a decode row** (``bounds``): the bytes bound, the time to read the row's K/V at the copy's rate, and the
  FMA bound, the time of the row's score (q.K) and PV FMAs at the faster of the fp32 rate and the rate of the row's
  cache dtype (bf16 rows on a CPU with AVX512-BF16 or AMX: torch's bf16 mm does two products per lane and
  instruction, as kvops' bf16 dot form does; the bf16 word form, ``KVOPS_NATIVE_BF16_DOT=0``, does fp32 FMAs, so its own
  FMA bound is up to twice this one); and the fraction of the copy's
  bandwidth eager kvops reaches (K/V bytes read per second over the copy's read + write bytes per second, the copy
  timed in the row's own rounds), whether the K/V fits in the last-level cache (then a sample's calls after its first
  read it from there), and the same calls with the K/V in the core's caches (``in_cache_case``: the fraction the
  kernel's own work allows; below the target, the kernel binds whatever the memory does).
* **Two threads against one** (``thread_speedup``): eager kvops timed at 1 and 2 torch threads interleaved in the same
  rounds, both with the wall clock (``torch.set_num_threads`` switched between samples, outside the timed region), so
  the speedup compares like with like (the per-row tables time 1 thread with the thread CPU clock); for decode also
  the same calls with the K/V in the core's caches (how the kernel's own work scales).
* **Packed against dense** (``packed_vs_dense``): ``kvops.packed.packed_attention`` over int8 and int4 packed K/V
  against dense ``kvops.paged_attention`` over the same values, bf16 decode.
* **Native build** (``native_build``): which kvops native build variant is loaded (``kvops.native.isa()``), for the
  header.
* **Per-target verdict** (``TargetReport``): the harness's report whose verdict gives one line per target (ok or MISS,
  the worst case's value and, for a miss, what it means).

Timing, spread and output format: ``benchmarks/_harness.py`` (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import pathlib

import torch

import _harness as harness

COPY_BYTES = 256 << 20  # per tensor: source and destination (512 MiB) exceed the caches of most hosts
MM_SIZE = 512  # fp32 [512, 512] @ [512, 512]: 0.27 GFLOP a call, compute bound on CPUs (fits L2)


_COPIES = {}


def copy_fn(device):
    """``dst.copy_(src)`` over two ``COPY_BYTES`` tensors on ``device`` (allocated on the first call, then kept): the
    copy whose read + write bytes (``2 * COPY_BYTES`` per call) per second the bandwidth target divides by."""
    if str(device) not in _COPIES:
        src = torch.ones(COPY_BYTES // 4, device=device)
        dst = torch.empty_like(src)
        _COPIES[str(device)] = lambda: dst.copy_(src)
    return _COPIES[str(device)]


def copy_bandwidth_gbs(device, clock: str, sync=None, rounds: int = 5) -> float:
    """Read + write bytes per second of :func:`copy_fn`'s copy (median over rounds)."""
    t = harness.interleave({"copy": copy_fn(device)}, rounds, clock=clock, sync=sync).time("copy").median
    return 2 * COPY_BYTES / t / 1e9


def fma_gflops(device, clock: str, sync=None, rounds: int = 5, dtype=torch.float32) -> float:
    """GFLOP/s (2 per FMA) of ``torch.mm`` of two ``[MM_SIZE, MM_SIZE]`` matrices of ``dtype`` (median over rounds):
    the host's FMA rate at the current torch thread count (MKL/oneDNN at their best vector ISA, or the one emulated)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(MM_SIZE, MM_SIZE, generator=g).to(device, dtype) for _ in range(2))
    out = torch.empty_like(a)
    t = harness.interleave({"mm": lambda: torch.mm(a, b, out=out)}, rounds, clock=clock, sync=sync).time("mm").median
    return 2 * MM_SIZE**3 / t / 1e9


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache's size (Linux sysfs, cpu0), or None where it cannot be read."""
    sizes = []
    for d in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            text = (d / "size").read_text().strip()
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]] if text[-1] in "KMG" else int(text))
    return max(sizes, default=None)


def row_gflops(host: dict, dtype) -> float:
    """The FMA rate that bounds a row whose cache is ``dtype``: the faster of fp32 and that dtype's ``torch.mm``."""
    return max(host["gflops"], host.get("gflops_" + str(dtype).removeprefix("torch."), 0.0))


def bounds(c: dict, r: dict, mode: str, gflops: float) -> dict:
    """A decode row's bounds (ms) and the fraction of the copy's bandwidth ``mode`` reaches (a Spread over rounds).

    ``c``: the case (``paged_decode.make_case``); ``r``: its measurement with the copy in its rounds
    (``paged_decode.measure(..., copy=...)``: ``copy_gbs``, and per candidate ``bw``, K/V GB/s, and ``fraction``, that
    over the copy's GB/s, per round). Bytes bound: K/V bytes / the copy's read + write GB/s (median). FMA bound: the
    score and PV FMAs (``2 * B * q_len * H_q * context * D``) at ``gflops`` / 2 FMA/s."""
    kv_bytes = c["k_dense"].numel() * 2 * c["k_dense"].element_size()
    batch, h_kv, _, d = c["k_dense"].shape
    fmas = 2 * batch * c["q_len"] * h_kv * c["group"] * c["context"] * d
    bytes_ms, fma_ms = kv_bytes / (r["copy_gbs"].median * 1e9) * 1e3, fmas / (gflops * 1e9 / 2) * 1e3
    b = dict(kv_bytes=kv_bytes, fmas=fmas, bytes_ms=bytes_ms, fma_ms=fma_ms,
             larger="bytes" if bytes_ms >= fma_ms else "FMAs", fraction=r["fraction"][mode])
    cached = f"{mode} in cache"  # the same calls, K/V in the caches (measure: in_cache_case)
    if cached in r["fraction"]:
        b.update(in_cache_fraction=r["fraction"][cached], in_cache_ms=r["ms"][cached])
    return b


def bounds_text(b: dict, r: dict, mode: str, gflops: float, verdict: str) -> str:
    """The sub-line under a decode row: the fraction of the copy's bandwidth, both bounds and which is larger, and the
    fraction with the K/V in the caches."""
    ms = r["ms"][mode]
    llc = last_level_cache_bytes()
    where = "" if llc is None else (
        f"; more than the {llc >> 20} MiB last-level cache" if b["kv_bytes"] > llc else
        f"; it fits in the {llc >> 20} MiB last-level cache: a sample's calls after its first read it from there")
    return (f"bandwidth: {mode} kvops reads the K/V ({b['kv_bytes'] / 1e6:.1f} MB{where}) at {r['bw'][mode]} GB/s = "
            f"{b['fraction']} of the copy's {r['copy_gbs']} GB/s timed in the same rounds (K/V bytes read per second "
            f"over the copy's read + write bytes per second, per round){verdict}; bounds: bytes {b['bytes_ms']:.3f} ms "
            f"(the K/V at the copy's rate), FMAs {b['fma_ms']:.3f} ms ({b['fmas'] / 1e6:.1f} M score+PV FMAs at "
            f"{gflops:.0f} GFLOP/s, the faster of fp32 and bf16 torch.mm): the {b['larger']} bound is the larger; "
            f"{mode} {ms:.3f} ms = {ms / max(b['bytes_ms'], b['fma_ms']):.2f}x it"
            + ("" if "in_cache_fraction" not in b else
               f"; with the K/V in the core's caches (every table cycling over {r['in_cache_blocks']} blocks, "
               f"{r['in_cache_kib']} KiB of K + V; the same calls) {b['in_cache_ms']:.3f} ms, "
               f"{b['in_cache_fraction']} of the copy's GB/s: the fraction the kernel's own work allows (it can "
               f"pass 1: cache against a copy from memory; below the target, the kernel binds; above it, the reads)"))


@contextlib.contextmanager
def torch_threads(n: int):
    """``torch.set_num_threads(n)`` inside, the previous count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def thread_speedup(fn, rounds: int, sync=None, cached=None) -> harness.Timings:
    """``fn`` at 1 and at 2 torch threads, interleaved (each sample in its own ``torch_threads``), wall clock both; with
    ``cached`` (the same calls over K/V in the caches: ``in_cache_case``) that too, as "1 thread in cache" and
    "2 threads in cache"."""
    fns = {"": fn} if cached is None else {"": fn, " in cache": cached}
    return harness.interleave({f"{n} thread{'s' * (n > 1)}{tag}": (f, lambda n=n: torch_threads(n))
                               for tag, f in fns.items() for n in (1, 2)},
                              rounds, clock="wall", sync=sync, max_reps=200)


def packed_vs_dense(c: dict, run_dense, rounds: int, clock: str, sync=None, formats=("int8", "int4")) -> dict:
    """Dense ``run_dense(c)`` (kvops.paged_attention over the paged cache) against ``kvops.packed.packed_attention``
    over the same K/V quantized per ``formats`` (default group sizes), a decode case of ``make_case``: per format the
    Spread of packed / dense time per round, the packed K/V bytes over the dense ones, and the largest |packed -
    dense| of the outputs (quantization error, not a kernel error)."""
    from kvops.packed import packed_attention, quantize_kv

    batch, h_kv, context, d = c["k_dense"].shape
    q = c["q"].view(batch, 1, -1, d)
    k, v = (c[n].transpose(1, 2) for n in ("k_dense", "v_dense"))  # [B, S, H_kv, D], the paged cache's values
    dense_bytes = 2 * k.numel() * k.element_size()
    packed = {f: (quantize_kv(k, f), quantize_kv(v, f)) for f in formats}
    cands = {"dense": lambda: run_dense(c)}
    for f, (pk, pv) in packed.items():
        cands[f] = lambda pk=pk, pv=pv: packed_attention(q, [pk], [pv])
    ref = run_dense(c).float()
    t = harness.interleave(cands, rounds, clock=clock, sync=sync, max_reps=200)
    res = {"dense_ms": t.time("dense", 1e3)}
    for f, (pk, pv) in packed.items():
        err = (cands[f]().view_as(ref).float() - ref).abs().max().item()
        res[f] = dict(ratio=t.ratio(f, "dense"), bytes=(pk.nbytes + pv.nbytes) / dense_bytes, err=err)
    return res


def native_build(native) -> str:
    """Which kvops native build is loaded (``kvops.native``): its variant (``native``: ``-march=native``;
    ``x86-64-v3``: AVX2 + FMA, chosen by ``KVOPS_NATIVE_ISA``) and the instruction sets its code was compiled for."""
    if not native.available():
        return "none (composite torch kernel)"
    code = ""
    with contextlib.suppress(Exception):  # the compiler's view of the variant (its preprocessor): informative only
        code = ", ".join(k.strip("_") for k, on in native.isa_macros().items() if on) or "no AVX2/AVX-512"
    return f"{native.isa()} (code for {code})" if code else str(native.isa())


class TargetReport(harness.Report):
    """The harness's report, its verdict giving one line per target: ok (every case holds) or MISS, how many cases
    hold, the worst case (the one furthest past, or closest to, the bound) with its value and, for a miss, what it
    means."""

    def verdict(self) -> list[str]:
        lines = super().verdict()
        out = []
        for i, line in enumerate(lines):
            if line.startswith("  meaning: ") and lines[i - 1].startswith("largest miss: "):
                continue  # its target's line below says it
            name = next((n for n in dict.fromkeys(t.target for t in self.targets) if line.startswith(f"  {n}: ")), None)
            if name is None:
                out.append(line)
                continue
            mine = [t for t in self.targets if t.target == name]
            worst = max(mine, key=lambda t: t.over)
            held = sum(t.met for t in mine)
            out.append(f"  {'ok  ' if held == len(mine) else 'MISS'} {name}: {held} of {len(mine)} hold; worst "
                       f"{worst.case}: {worst.value} ({worst.op} {worst.bound:g})")
            if not worst.met and worst.meaning:
                out.append(f"       meaning: {worst.explain()}")
        return out

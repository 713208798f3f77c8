"""One-shot GPU check for kvops' Triton kernels: on a CUDA machine (< 10 minutes), or ``--aot`` without a GPU.

Stages, each guarded (a failing stage is reported and the next one runs) and time-limited:

1. every Triton test (``tests/test_*triton*.py``) on CUDA (the tests use CUDA tensors when CUDA is available);
2. both examples with ``--device cuda`` (``examples/llm_serving.py``, ``examples/streaming_video.py``), bf16;
3. timings with CUDA events (median of repeated launches after warm-up) of
   * paged decode (B = 32 x context 4096, Qwen2.5-0.5B 14/2 x 64 and Llama-3.1-8B 32/8 x 128, bf16) and chunked
     prefill (4 x (512 cached + 128 new)) through ``kvops.paged_attention``, vs SDPA over a contiguous cache with
     query heads folded (the unpaged ideal),
   * ``kvops.paged_cache_write`` (8192 tokens into a paged cache) and ``kvops.cache_write`` (contiguous cache),
   against the device's measured copy bandwidth (``copy_`` of 1 GiB, read + write);
4. one summary table: stage, status, seconds, and for kernels time, GB/s of the bytes they must move, and the
   fraction of copy bandwidth (and the ratio to the ideal for attention);
5. on the device: the launchers' plans for a few production shapes compiled by Triton for this device, with the
   resources the loaded kernel handle reports (``n_regs``, ``n_spills``, ``metadata.shared``) next to what the
   cubin says (``cuobjdump``), as the ahead-of-time check reads them.

``--aot`` needs no GPU: it compiles every kernel and specialization the launchers plan (``tools/aot.py``,
cases in ``tools/aot_cases.py``) to cubins for sm_80, sm_86, sm_89, sm_90 and sm_100, and prints one table per
target (kernel, specialization, status, registers, spills, shared memory, num_warps, estimated occupancy); exit 1 if
anything fails to compile, spills or exceeds the target's shared memory. ``--subset`` runs the CI subset.

    python benchmarks/gpu_check.py [--skip-tests] [--skip-examples] [--budget-s 540]
    python benchmarks/gpu_check.py --aot [--subset] [--targets sm_80,sm_90] [--kernels REGEX] [--progress]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
rows: list[tuple] = []  # (stage, status, seconds, detail)


def stage(name: str, fn, *args):
    t0 = time.perf_counter()
    try:
        detail = fn(*args)
        status = "ok"
    except Exception as e:  # report and continue with the next stage
        detail = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        status = "FAIL"
        traceback.print_exc()
    rows.append((name, status, time.perf_counter() - t0, detail or ""))
    print(f"[{status}] {name} ({rows[-1][2]:.1f} s) {detail or ''}", flush=True)


def run_cmd(cmd: list[str], timeout_s: float) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("TRITON_INTERPRET", None)  # real GPU launches
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
    if p.returncode != 0:
        print(p.stdout[-4000:], p.stderr[-4000:], sep="\n")
        raise RuntimeError(f"exit {p.returncode}: {tail[0]}")
    return tail[0][:100]


def cuda_time_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` between CUDA events (after 3 warm-up calls)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth():
    import torch

    src = torch.ones(1 << 28, device="cuda")  # 1 GiB fp32
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src))
    bw = 2 * src.numel() * 4 / (ms * 1e-3) / 1e9
    timings["copy_ 1 GiB"] = (ms, bw, None)
    return f"{bw:.0f} GB/s (read + write)"


timings: dict = {}  # name -> (ms, GB/s, ratio to ideal or None)


def attention_timings():
    import torch
    import torch.nn.functional as F

    import kvops

    dev, dtype, bs = "cuda", torch.bfloat16, 16
    for name, (h_q, h_kv, d) in {"qwen2.5-0.5b": (14, 2, 64), "llama-3.1-8b": (32, 8, 128)}.items():
        for kind, batch, q_len, ctx in (("decode B=32 ctx=4096", 32, 1, 4096), ("prefill 4x(512+128)", 4, 128, 640)):
            g = h_q // h_kv
            nblk = batch * ctx // bs
            k_cache = torch.randn(nblk + 8, bs, h_kv, d, device=dev, dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            table = torch.randperm(nblk + 8, device=dev)[:nblk].view(batch, -1).int()
            q = torch.randn(batch * q_len, h_q, d, device=dev, dtype=dtype)
            seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
            cu = torch.arange(0, batch * q_len + 1, q_len, device=dev, dtype=torch.int32)
            kd = k_cache[table.long()].flatten(1, 2).transpose(1, 2).contiguous()
            vd = v_cache[table.long()].flatten(1, 2).transpose(1, 2).contiguous()
            qf = q.view(batch, q_len, h_kv, g, d).permute(0, 2, 1, 3, 4).reshape(batch, h_kv, q_len * g, d)
            mask = None
            if q_len > 1:
                pos = ctx - q_len + torch.arange(q_len, device=dev).repeat_interleave(g)
                mask = torch.arange(ctx, device=dev)[None, :] <= pos[:, None]
            ideal = cuda_time_ms(lambda: F.scaled_dot_product_attention(qf, kd, vd, attn_mask=mask))
            ours = cuda_time_ms(lambda: kvops.paged_attention(q, k_cache, v_cache, cu, seq_lens, table, q_len))
            kv_bytes = kd.numel() * 2 * kd.element_size()
            timings[f"attn {name} {kind}"] = (ours, kv_bytes / (ours * 1e-3) / 1e9, ours / ideal)
            del k_cache, v_cache, kd, vd
    return f"{len(timings) - 1} kernels timed"


def write_timings():
    import torch

    import kvops

    dev, dtype = "cuda", torch.bfloat16
    n, h_kv, d, bs = 8192, 8, 128, 16
    k_cache = torch.zeros(n // bs + 8, bs, h_kv, d, device=dev, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(n, h_kv, d, device=dev, dtype=dtype), torch.randn(n, h_kv, d, device=dev, dtype=dtype)
    slots = torch.randperm(k_cache.shape[0] * bs, device=dev)[:n]
    ms = cuda_time_ms(lambda: kvops.paged_cache_write(key, value, k_cache, v_cache, slots))
    moved = 2 * 2 * key.numel() * key.element_size()  # read K/V + write K/V
    timings["paged_cache_write 8192 tok 8x128"] = (ms, moved / (ms * 1e-3) / 1e9, None)
    kc = torch.zeros(4, 4096, h_kv, d, device=dev, dtype=dtype)
    vc = torch.zeros_like(kc)
    k4, v4 = key.view(4, 2048, h_kv, d), value.view(4, 2048, h_kv, d)
    ms = cuda_time_ms(lambda: kvops.cache_write(k4, v4, kc, vc, start=1024))
    timings["cache_write 4x2048 tok 8x128"] = (ms, moved / (ms * 1e-3) / 1e9, None)
    return "2 writes timed"


def aot_tables(rows, refusals, verbose: bool) -> int:
    """Print one table per target (every row with ``verbose``, else the failures and each kernel's worst case) and a
    per-kernel summary; returns the number of failures."""
    fails = [r for r in rows if r["status"] != "ok"]
    fmt = "{:<22} {:<6} {:>4} {:>6} {:>7} {:>5} {:>5}  {}"
    for target in dict.fromkeys(r["target"] for r in rows):
        mine = [r for r in rows if r["target"] == target]
        print(f"\n=== {target}: {len(mine)} compiles, {sum(r['status'] != 'ok' for r in mine)} failed ===")
        shown = [r for r in mine if verbose or r["status"] != "ok"]
        if not shown:
            print("(no failures; --verbose lists every compile)")
            continue
        print(fmt.format("kernel", "status", "regs", "spills", "shared", "warps", "occ", "specialization / cause"))
        for r in mine:
            if verbose or r["status"] != "ok":
                print(fmt.format(r["kernel"], r["status"], r["regs"] if r["regs"] is not None else "-",
                                 r["spills"] if r["spills"] is not None else "-",
                                 r["shared"] if r["shared"] is not None else "-", r["num_warps"],
                                 f"{r['occupancy']:.2f}" if r["occupancy"] is not None else "-",
                                 r["spec"] + (f"  [{r['error']}]" if r["error"] else "")))
    print("\n=== worst case per kernel and target (max registers / spills / shared, min occupancy) ===")
    print(f"{'target':<7} {'kernel':<22} {'n':>4} {'fail':>4} {'regs':>5} {'spills':>6} {'shared':>7} {'occ':>5}")
    for target in dict.fromkeys(r["target"] for r in rows):
        for kernel in sorted({r["kernel"] for r in rows if r["target"] == target}):
            ks = [r for r in rows if r["target"] == target and r["kernel"] == kernel]
            ok = [r for r in ks if r["regs"] is not None]
            worst = lambda key: max((r[key] for r in ok), default="-")  # noqa: E731
            occ = min((r["occupancy"] for r in ok), default=None)
            print(f"{target:<7} {kernel:<22} {len(ks):>4} {sum(r['status'] != 'ok' for r in ks):>4} "
                  f"{worst('regs'):>5} {worst('spills'):>6} {worst('shared'):>7} "
                  f"{f'{occ:.2f}' if occ is not None else '-':>5}")
    for label, target, msg in refusals:
        print(f"refused by design on {target}: {label}: {msg}")
    return len(fails)


def aot_main(args) -> None:
    sys.path.insert(0, str(ROOT))
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("gpu_check --aot: unset TRITON_INTERPRET (the interpreter replaces the kernels)")
    from tools import aot

    t0 = time.perf_counter()
    targets = args.targets.split(",") if args.targets else list(aot.TARGETS)
    def progress(row):  # one line per compile as it ends: a run stopped by a timeout still leaves its results
        print(f"[{row['status']}] {row['target']} {row['kernel']} regs={row['regs']} spills={row['spills']} "
              f"shared={row['shared']} warps={row['num_warps']} {row['spec']} {row['error']}", flush=True)

    rows, refusals = aot.check(targets, subset=args.subset, workers=args.workers, kernels=args.kernels,
                               on_row=progress if args.progress else None)
    failed = aot_tables(rows, refusals, args.verbose)
    print(f"\n{len(rows)} compiles for {', '.join(targets)} in {time.perf_counter() - t0:.0f} s: {failed} failed")
    sys.exit(1 if failed else 0)


def device_resources():
    """Compile the launchers' plans for this device and compare the kernel handle's resources with the cubin's."""
    import torch
    import triton

    from tools import aot, aot_cases

    cap = torch.cuda.get_device_capability()
    target = next((t for t in aot.TARGETS.values() if t.capability == cap), None)
    lines, mismatches = [], 0
    for label, make in aot_cases.cases(subset=True):
        for launch in make(cap):
            spec = aot.bind(launch, cap)
            src = triton.compiler.ASTSource(launch.kernel, dict(spec.signature), dict(spec.constexprs),
                                            {k: [list(a) for a in v] for k, v in spec.attrs})
            ck = triton.compile(src, options=dict(spec.options))  # this device's target
            ck._init_handles()  # loads the module: the driver reports registers, spills, shared memory
            res = aot.cubin_resources(ck.asm["cubin"])
            spills = res.get("LOCAL", 0) + res.get("STACK", 0)
            same = ck.n_regs == res.get("REG") and (ck.n_spills > 0) == (spills > 0)
            mismatches += not same
            lines.append(f"{aot.kernel_name(launch.kernel):<22} device regs {ck.n_regs:>3} spills {ck.n_spills:>4} "
                         f"shared {ck.metadata.shared:>6} | cubin regs {res.get('REG'):>3} stack+local "
                         f"{spills:>4} {'' if same else 'MISMATCH '}{label}")
    print("\n".join(lines))
    if mismatches:
        raise RuntimeError(f"{mismatches} kernels: device-reported resources differ from the cubin's")
    return f"{len(lines)} kernels, device = cubin ({target.name if target else cap})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aot", action="store_true", help="no GPU needed: compile every kernel the launchers plan for sm_80, sm_86, sm_89, "
                             "sm_90 and sm_100 and report registers, spills and shared memory")
    parser.add_argument("--subset", action="store_true", help="--aot: the CI subset only")
    parser.add_argument("--targets", default="", help="--aot: comma-separated, e.g. sm_80,sm_90 (default: all)")
    parser.add_argument("--workers", type=int, default=2, help="--aot: compile processes (at most 2)")
    parser.add_argument("--verbose", action="store_true", help="--aot: print every compile, not only failures")
    parser.add_argument("--kernels", default="", help="--aot: only kernels whose name matches this regex")
    parser.add_argument("--progress", action="store_true", help="--aot: one line per compile as it ends")
    parser.add_argument("--skip-tests", action="store_true", help="skip stage 1 (the Triton tests on CUDA)")
    parser.add_argument("--skip-examples", action="store_true", help="skip stage 2 (the examples with --device cuda)")
    parser.add_argument("--budget-s", type=float, default=540, help="overall time budget for the test/example stages")
    args = parser.parse_args()
    if args.aot:
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (as the test does)
        aot_main(args)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: CUDA is not available on this machine (this script is for GPU machines)")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    t_start = time.perf_counter()
    left = lambda: max(30.0, args.budget_s - (time.perf_counter() - t_start))  # noqa: E731
    if not args.skip_tests:
        tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*triton*.py"))
        stage("triton tests on CUDA", run_cmd, [sys.executable, "-m", "pytest", "-q", "-x", *tests], 0.5 * left())
    if not args.skip_examples:
        stage("examples/llm_serving.py --device cuda", run_cmd,
              [sys.executable, "examples/llm_serving.py", "--device", "cuda", "--dtype", "bfloat16"], 0.3 * left())
        stage("examples/streaming_video.py --device cuda", run_cmd,
              [sys.executable, "examples/streaming_video.py", "--device", "cuda", "--dtype", "bfloat16"], 0.5 * left())
    stage("copy bandwidth", copy_bandwidth)
    stage("attention kernels (Triton)", attention_timings)
    stage("cache writes (Triton)", write_timings)
    stage("kernel resources: device vs cubin", device_resources)

    print("\n=== gpu_check summary ===")
    print(f"{'stage':<44} {'status':<6} {'s':>7}  detail")
    for name, status, secs, detail in rows:
        print(f"{name:<44} {status:<6} {secs:>7.1f}  {detail}")
    if timings:
        copy_bw = timings.get("copy_ 1 GiB", (0, 0, None))[1]
        print(f"\n{'kernel':<44} {'ms':>8} {'GB/s':>8} {'of copy':>8} {'/ideal':>7}")
        for name, (ms, bw, ratio) in timings.items():
            frac = f"{bw / copy_bw:.0%}" if copy_bw else "-"
            print(f"{name:<44} {ms:>8.3f} {bw:>8.0f} {frac:>8} {f'{ratio:.2f}' if ratio else '-':>7}")
    sys.exit(1 if any(r[1] != "ok" for r in rows) else 0)


if __name__ == "__main__":
    main()

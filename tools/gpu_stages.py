"""Stages of ``benchmarks/gpu_check.py`` beyond the oracle sweep (tools/gpu_oracle.py): the environment, the oracle's
self-check, a compiled decode step under CUDA graphs, Inductor's code for projection -> RoPE -> paged write, and
timings against SDPA and the device's measured bandwidth. Each returns a one-line detail and may write a file; each
raises on failure. Only torch (and triton on CUDA) are needed.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import platform
import re
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def environment(facts: dict) -> str:
    """Versions and the device; fails if kvops did not import or its native CPU build was required to."""
    import kvops
    from kvops.triton import HAS_TRITON

    facts.update(python=platform.python_version(), torch=torch.__version__, kvops=kvops.__version__,
                 kvops_path=str(pathlib.Path(kvops.__file__).parent), has_triton=HAS_TRITON,
                 cuda=torch.cuda.is_available())
    if HAS_TRITON:
        import triton

        facts["triton"] = triton.__version__
    if facts["cuda"]:
        p = torch.cuda.get_device_properties(0)
        facts.update(device=p.name, capability=list(torch.cuda.get_device_capability()), sms=p.multi_processor_count,
                     memory_gib=round(p.total_memory / 2**30, 1), cuda_runtime=torch.version.cuda)
    _no_native()
    return ", ".join(f"{k} {facts[k]}" for k in ("python", "torch", "triton", "device", "capability") if k in facts)


def oracle_self_check() -> str:
    """The sweep's fp64 attention oracle against kvops/reference/attention.py (the readable per-query reference)
    with every feature, then one case of each family of the sweep on CPU (kvops' CPU kernels)."""
    sys.path.insert(0, str(ROOT))
    from kvops.reference.attention import reference
    from tools import gpu_oracle as o

    worst = 0.0
    for seed, (mode, flags) in enumerate((("decode", ("window", "softcap", "sinks", "alibi", "leftpad",
                                                       "sink_tokens", "rope")),
                                          ("prefill", ("right", "alibi", "leftpad", "rope")),
                                          ("prefill", ("window", "sinks", "sink_tokens", "rope")))):
        small = ([1, 0, 9, 30, 45], [1, 0, 1, 1, 1] if mode == "decode" else [1, 0, 4, 1, 6])
        args, extra, seq_lens, q_lens = o.paged_inputs("cpu", "fp8" if seed == 1 else "fp32", 16, 3, 4, "NHD", mode,
                                                       seed, lens=small)
        opts = o.feature_options(flags, args["q"].shape[1], seq_lens, q_lens, o._gen(seed))
        kw = dict(k_scale=extra["k_scale"], v_scale=extra["v_scale"], **opts)
        a = o.attention_oracle(**args, **kw)
        b = reference(**args, **kw)
        for x, y in zip(a, b):
            if not torch.equal(x.isneginf(), y.isneginf()):
                raise AssertionError(f"oracle and kvops/reference/attention disagree on -inf ({mode} {flags})")
            fin = torch.isfinite(y)
            worst = max(worst, float((x[fin] - y[fin]).abs().max()))
    if worst > 1e-9:
        raise AssertionError(f"oracle vs kvops/reference/attention: max difference {worst:.2e} (fp64: <= 1e-9)")
    families, picked = set(), []
    for case in o.cases():
        key = case[0] if case[0] != "attention" else f"attention {case[6]}"
        if key not in families:
            families.add(key)
            picked.append(case)
    bad = []
    for i, case in enumerate(picked):
        ok, detail = o.run_case(case, "cpu", seed=i)
        if not ok:
            bad.append(f"{o.label(case)}: {detail}")
    if bad:
        raise AssertionError("CPU kernels vs the oracle: " + "; ".join(bad))
    _no_native()
    return f"oracle = reference within {worst:.1e}; {len(picked)} families ok on CPU"


def _no_native() -> None:
    """Under gpu_check (``KVOPS_NATIVE=0``) kvops' native CPU kernel is never built nor loaded."""
    native = [m for m in sys.modules if m.startswith("kvops_native")]
    if native and os.environ.get("KVOPS_NATIVE") == "0":
        raise RuntimeError(f"kvops' native CPU kernel was loaded ({native}): the GPU check must not need it")


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"kvops_example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def cudagraph_decode(out_dir: pathlib.Path | None, device: str = "cuda", steps: int = 6, layers: int = 2) -> str:
    """``examples/llm_serving.py``'s model (2 layers, bf16) decoding 4 sequences through a paged cache, compiled with
    ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs) with the caches marked static: fails on
    any "skipping cudagraphs" (counter or log), on a cache reallocated or copied, or when a step's cache rows or
    tokens differ from eager's on the same state."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from kvops.cache import PagedKVCache

    ex = load_example("llm_serving")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = ex.Model(layers, 4096).to(device, dtype).eval()
    cache = PagedKVCache(64, 16, ex.H_KV, ex.HEAD_DIM, num_layers=layers, dtype=dtype, device=device)
    caches = [*cache.k_caches, *cache.v_caches]
    for c in caches:
        torch._dynamo.mark_static_address(c)
    ptrs = [c.data_ptr() for c in caches]
    seqs = {f"s{i}": n for i, n in enumerate((5, 17, 33, 60))}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rid, n in seqs.items():  # eager prefill
            cache.add_sequence(rid)
            step = cache.prepare({rid: n})
            meta = dict(slot_mapping=step.slot_mapping, cu_seqlens_q=step.cu_seqlens_q, seq_lens=step.seq_lens,
                        block_table=step.block_table, max_seqlen_q=step.max_seqlen_q)
            ids = torch.randint(0, 4096, (n,), generator=gen).to(device)
            model(ids, step.positions, cache.k_caches, cache.v_caches, meta)
        torch._dynamo.reset()
        counters.clear()
        records = _Records()
        log = logging.getLogger("torch._inductor")
        log.addHandler(records)
        torch._logging.set_logs(cudagraphs=True)  # the artifact log that says "skipping cudagraphs due to ..."
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        tokens = torch.randint(0, 4096, (8,), generator=gen).to(device)
        lines, worst = [], 0.0
        try:
            for i in range(steps):
                step = cache.prepare([(rid, 1) for rid in seqs], pad_tokens=8, pad_batch=8, max_blocks=8)
                meta = dict(slot_mapping=step.slot_mapping, cu_seqlens_q=step.cu_seqlens_q, seq_lens=step.seq_lens,
                            block_table=step.block_table, max_seqlen_q=step.max_seqlen_q)
                ref_k, ref_v = [c.clone() for c in cache.k_caches], [c.clone() for c in cache.v_caches]
                want = model(tokens, step.positions, ref_k, ref_v, meta)
                got = compiled(tokens, step.positions, cache.k_caches, cache.v_caches, meta)
                if device == "cuda":
                    torch.cuda.synchronize()
                for a, b in zip([*cache.k_caches, *cache.v_caches], [*ref_k, *ref_v]):
                    worst = max(worst, float((a.float() - b.float()).abs().max()))
                same = torch.equal(got, want)
                lines.append(f"step {i}: tokens {'=' if same else '!='} eager, max |cache - eager| {worst:.3g}")
                tokens = torch.cat((got, tokens[len(got):]))[:8]
        finally:
            torch._logging.set_logs()
            log.removeHandler(records)
    skips = counters["inductor"]["cudagraph_skips"]
    skipped = [m for m in records.messages if "skipping cudagraphs" in m]
    moved = [c.data_ptr() for c in [*cache.k_caches, *cache.v_caches]] != ptrs
    text = "\n".join([*lines, f"cudagraph_skips counter: {skips}", *skipped,
                      f"graphs: {counters['stats']['unique_graphs']}", f"cache storage moved: {moved}"])
    if out_dir is not None:
        (out_dir / "cudagraphs.txt").write_text(text + "\n")
    # compiled vs eager numerics (bf16: fused RoPE and norms round differently; two layers) on values of order 1
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    problems = ([f"{skips} cudagraph skip(s): {skipped[:1]}"] if skips or skipped else []) + \
        (["a cache was reallocated"] if moved else []) + ([f"cache rows differ from eager by {worst:.3g}"]
                                                          if worst > tol else [])
    if problems:
        raise AssertionError("; ".join(problems))
    return f"{steps} decode steps, 0 cudagraph skips, caches in place (max |cache - eager| {worst:.2g})"


def rope_roll(x, cos, sin_signed):
    """Rotate-half RoPE in fp32 (``roll``: one kernel on CPU as on CUDA); ``sin_signed`` has its first half negated."""
    xf = x.float()
    return (xf * cos + torch.roll(xf, x.shape[-1] // 2, dims=-1) * sin_signed).to(x.dtype)


def fusion_code(out_dir: pathlib.Path | None, device: str = "cuda") -> str:
    """Inductor's code for ``k, v = x @ w_kv``, ``k = rope(k)``, ``kvops.paged_cache_write(k, v, ...)``: one
    generated kernel besides the projection's matmul, no call of kvops' op (the lowering fused the write), and the
    cache equal to eager's bit for bit."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    import kvops

    n, hidden, h, d, bs = 24, 256, 4, 64, 16
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, hidden, generator=g).to(device, dtype)
    w = (torch.randn(hidden, 2 * h * d, generator=g) / hidden ** 0.5).to(device, dtype)
    pos = torch.arange(n, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
    cos = torch.cat((pos.cos(), pos.cos()), -1)[:, None].to(device)
    sin = torch.cat((-pos.sin(), pos.sin()), -1)[:, None].to(device)
    slots = torch.randperm(8 * bs, generator=g)[:n].to(device)
    slots[3] = -1

    def step(x, w, cos, sin, k_cache, v_cache, slots):
        k, v = (x @ w).view(x.shape[0], 2, h, d).unbind(1)
        kvops.paged_cache_write(rope_roll(k, cos, sin), v, k_cache, v_cache, slots)

    k_cache, v_cache = torch.zeros(8, bs, h, d, device=device, dtype=dtype), torch.zeros(8, bs, h, d, device=device,
                                                                                          dtype=dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(step, fullgraph=True), x, w, cos, sin, k_cache, v_cache, slots)
    step(x, w, cos, sin, ref_k, ref_v, slots)
    code = "\n".join(codes)
    if out_dir is not None:
        (out_dir / "fusion_code.txt").write_text(code)
    kernels = re.findall(r"^(\w+) = async_compile\.(?:triton|cpp_pybinding|cpp)\(", code, re.M)
    calls = re.findall(r"(?<!')torch\.ops\.kvops\.\w+\.default\(", code)
    # eager RoPE vs the fused kernel's (which may contract to fma): within one rounding of the cache dtype
    rtol = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
    same = all(torch.allclose(a.float(), b.float(), rtol=rtol, atol=rtol)
               for a, b in ((k_cache, ref_k), (v_cache, ref_v)))
    detail = f"{len(kernels)} generated kernel(s) {kernels}, {len(calls)} kvops call(s), cache == eager: {same}"
    if len(kernels) != 1 or calls or not same:
        raise AssertionError(detail + " (want 1 fused kernel, no kvops call, equal caches; code in fusion_code.txt)")
    return detail


# --- timings --------------------------------------------------------------------------------------------------------
def cuda_time_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` between CUDA events (after 3 warm-up calls)."""
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


def copy_bandwidth(timings: dict) -> str:
    """The device's measured HBM bandwidth: ``copy_`` of 1 GiB fp32 (read + write), far past the L2."""
    src = torch.ones(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src))
    bw = 2 * src.numel() * 4 / (ms * 1e-3) / 1e9
    timings["copy_ 1 GiB"] = (ms, bw, None)
    del src, dst
    return f"{bw:.0f} GB/s (read + write)"


def attention_timings(timings: dict, deadline: float) -> str:
    """Paged decode (B = 32 x 4096) and chunked prefill (4 x (512 + 128)) through ``kvops.paged_attention`` vs SDPA
    over a contiguous cache with the query heads folded (the unpaged ideal); Qwen2.5-0.5B and Llama-3.1-8B heads."""
    import torch.nn.functional as F

    import kvops

    dev, dtype, bs = "cuda", torch.bfloat16, 16
    n = 0
    for name, (h_q, h_kv, d) in {"qwen2.5-0.5b": (14, 2, 64), "llama-3.1-8b": (32, 8, 128)}.items():
        for kind, batch, q_len, ctx in (("decode B=32 ctx=4096", 32, 1, 4096), ("prefill 4x(512+128)", 4, 128, 640)):
            if time.monotonic() > deadline:
                return f"{n} timed (deadline)"
            g, nblk = h_q // h_kv, batch * ctx // bs
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
            n += 1
            del k_cache, v_cache, kd, vd
    return f"{n} attention shapes timed"


def write_timings(timings: dict) -> str:
    """``kvops.paged_cache_write`` (8192 tokens, random slots) and ``kvops.cache_write`` (contiguous), bf16."""
    import kvops

    dev, dtype = "cuda", torch.bfloat16
    n, h_kv, d, bs = 8192, 8, 128, 16
    k_cache = torch.zeros(n // bs + 8, bs, h_kv, d, device=dev, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(n, h_kv, d, device=dev, dtype=dtype), torch.randn(n, h_kv, d, device=dev, dtype=dtype)
    slots = torch.randperm(k_cache.shape[0] * bs, device=dev)[:n]
    moved = 2 * 2 * key.numel() * key.element_size()  # read K/V + write K/V
    ms = cuda_time_ms(lambda: kvops.paged_cache_write(key, value, k_cache, v_cache, slots))
    timings["paged_cache_write 8192 tok 8x128"] = (ms, moved / (ms * 1e-3) / 1e9, None)
    kc = torch.zeros(4, 4096, h_kv, d, device=dev, dtype=dtype)
    vc = torch.zeros_like(kc)
    k4, v4 = key.view(4, 2048, h_kv, d), value.view(4, 2048, h_kv, d)
    ms = cuda_time_ms(lambda: kvops.cache_write(k4, v4, kc, vc, start=1024))
    timings["cache_write 4x2048 tok 8x128"] = (ms, moved / (ms * 1e-3) / 1e9, None)
    return "2 writes timed"


def device_resources(out_dir: pathlib.Path | None) -> str:
    """The CI subset's plans compiled by Triton for this device; the loaded kernel's registers, spills and shared
    memory against the cubin's (as the ahead-of-time check reads them, tools/aot.py)."""
    import triton

    sys.path.insert(0, str(ROOT))
    from tools import aot, aot_cases

    cap = torch.cuda.get_device_capability()
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
    if out_dir is not None:
        (out_dir / "resources.txt").write_text("\n".join(lines) + "\n")
    if mismatches:
        raise AssertionError(f"{mismatches} kernels: device-reported resources differ from the cubin's")
    return f"{len(lines)} kernels, device = cubin (capability {cap})"

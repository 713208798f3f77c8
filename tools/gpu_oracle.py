"""The oracle stage of ``benchmarks/gpu_check.py``: every Triton kernel kvops launches, called through the public ops
on a device, against an oracle, over dtypes, head dims, GQA groups, block sizes, layouts and features.

- Attention (``kvops.paged_attention``: ``_prefill_kernel``, ``_decode_split_kernel`` + ``_decode_merge_kernel``)
  against :func:`attention_oracle`, a plain fp64 attention (one masked softmax per sequence) with every feature of
  docs/attention_features.md; per-dtype tolerances (those of tests/paged/test_paged_attention.py), LSE included.
- Packed attention (``kvops.packed.packed_attention``: ``_segment_kernel``) against fp64 softmax attention over the
  window dequantized by the CPU kernel.
- Data movement (``_paged_scatter_kernel``, ``_rotary_scatter_kernel``, ``_copy_rows_kernel``, ``_staging_kernel``,
  the packed ``_int*_quant``/``_int*_dequant`` kernels) against kvops' CPU kernels on the same inputs, bit for bit
  (the rotary write within one rounding of its dtype, dequantization within fp32 rounding).
- MLA (``kvops/ops/mla.py``: ``_mla_attention_kernel`` with the split-KV merge, ``_mla_write_kernel``): attention at
  DeepSeek's widths against :func:`attention_oracle` over the latent rows as one KV head, the write against the CPU
  kernel as the paged write.

Caches start as NaN (or random bits) everywhere a kernel must not read or write. Axes: fp16/bf16/fp32 and fp8 e4m3
caches; head dims 64, 128, 256; GQA groups 1, 4, 7, 8; block sizes 1, 16, 64; NHD and HND; causal, window, softcap,
sinks, ALiBi, ``cache_leftpad``, sink tokens, RoPE at read, right window; decode and chunked prefill. :func:`cases`
interleaves the families, so a run stopped by its deadline has still called every kernel. With ``device="cpu"`` the
same sweep checks the oracle and the cases against kvops' CPU kernels (``tests/gpu/test_gpu_check.py``).

Needs only torch (and triton for the CUDA kernels): it runs on the lent GPU machine's image as it is.
"""

from __future__ import annotations

import itertools
import math
import time

import torch

F64 = torch.float64
FP8 = torch.float8_e4m3fn
FLOATS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}  # (atol, rtol)
LSE_TOL = 2e-4
HEAD_DIMS, GROUPS, BLOCK_SIZES = (64, 128, 256), (1, 4, 7, 8), (1, 16, 64)
FEATURES = ("alibi", "leftpad", "sink_tokens", "rope", "right")  # docs/attention_features.md


# --- the fp64 attention oracle -------------------------------------------------------------------------------------
def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float, scale: float) -> torch.Tensor:
    """fp64 ``x [N, H, D]`` rotated GPT-NeoX style at ``positions [N]`` (as kvops/reference/attention.rope_rotate)."""
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=F64, device=x.device)
    ang = (positions.to(F64) / scale)[:, None] * theta ** (-2.0 * i / d)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention_oracle(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *, scale=None, causal=True,
                     window_left=-1, softcap=0.0, sinks=None, k_scale=None, v_scale=None, alibi_slopes=None,
                     window_right=-1, cache_leftpad=None, sink_tokens=0, rope_theta=None, rope_scale=1.0):
    """``(out [T, H_q, D_v], lse [H_q, T])`` in fp64 on ``q``'s device, for NHD caches ``[P, block_size, H_kv, D]``:
    the semantics of kvops/reference/attention.py (docs/semantics.md, docs/attention_features.md), one masked
    softmax per sequence instead of one loop per query. Rows no query may see are never gathered."""
    t_q, h_q, d = q.shape
    bs, h_kv, d_v = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    g, dev = h_q // h_kv, q.device
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(t_q, h_q, d_v, dtype=F64, device=dev)
    lse = torch.full((h_q, t_q), -math.inf, dtype=F64, device=dev)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    pads = [0] * len(lens) if cache_leftpad is None else cache_leftpad.tolist()

    def per_head(s):  # a per-tensor [1] or per-KV-head [H_kv] scale, as [H_kv, 1]
        return torch.ones(h_kv, 1, dtype=F64, device=dev) if s is None else \
            s.to(dev, F64).flatten()[torch.arange(h_kv, device=dev) % s.numel()][:, None]

    for b, kv_len in enumerate(lens):
        q0, q1, start = cu[b], cu[b + 1], pads[b]
        if q1 == q0:
            continue
        j = torch.arange(kv_len, device=dev)
        blocks, rows = block_table[b].long()[j // bs], j % bs
        k = (k_cache[blocks, rows].to(F64) * per_head(k_scale)).repeat_interleave(g, dim=1)  # [L, H_q, D]
        v = (v_cache[blocks, rows].to(F64) * per_head(v_scale)).repeat_interleave(g, dim=1)
        pos = kv_len - (q1 - q0) + torch.arange(q1 - q0, device=dev)  # each query's position
        allowed = (j[None] >= start).expand(q1 - q0, kv_len)
        if causal:
            allowed = allowed & (j[None] <= pos[:, None])
        elif window_right >= 0:
            allowed = allowed & (j[None] <= pos[:, None] + window_right)
        is_sink = j < start + sink_tokens
        if window_left >= 0:
            allowed = allowed & ((j[None] >= pos[:, None] - window_left) | is_sink[None])
        qs = q[q0:q1].to(F64) * scale  # [Tq, H_q, D]
        if rope_theta is not None:
            k = _rope(k, j - start, rope_theta, rope_scale)
            s = torch.einsum("thd,lhd->htl", _rope(qs, pos - start, rope_theta, rope_scale), k)
            if sink_tokens and window_left >= 0:  # sink keys see the query turned back by the evicted gap
                gap = (pos - window_left - (start + sink_tokens)).clamp(min=0)
                s_sink = torch.einsum("thd,lhd->htl", _rope(qs, pos - start - gap, rope_theta, rope_scale), k)
                s = torch.where(is_sink[None, None, :], s_sink, s)
        else:
            s = torch.einsum("thd,lhd->htl", qs, k)  # [H_q, Tq, L]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        if alibi_slopes is not None:
            slope = (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]).to(dev, F64)
            s = s - slope[:, None, None] * (pos[:, None] - j[None]).abs()[None]
        s = s.masked_fill(~allowed[None], -math.inf)
        terms = s if sinks is None else torch.cat((s, sinks.to(dev, F64)[:, None, None].expand(h_q, q1 - q0, 1)), -1)
        m = terms.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(terms - m)
        den = e.sum(-1, keepdim=True)
        lse[:, q0:q1] = torch.where(den[..., 0] > 0, m[..., 0] + den[..., 0].log(), -math.inf)
        w = torch.where(den > 0, e[..., :kv_len] / den, torch.zeros_like(e[..., :kv_len]))
        out[q0:q1] = torch.einsum("htl,lhd->thd", w, v)
    return out, lse


# --- inputs --------------------------------------------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape, gen, dtype=torch.float32, device="cpu"):
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def paged_inputs(device, dtype: str, d: int, group: int, bs: int, layout: str, mode: str, seed: int, h_kv: int = 2,
                 lens: tuple[list, list] | None = None):
    """Ragged paged inputs (a padding row, chunked prefill, sequences over several blocks), permuted block tables,
    NaN in every slot no sequence holds. fp8: e4m3 caches with per-KV-head scales and bf16 queries. ``lens``:
    ``(seq_lens, q_lens)`` instead of the mode's."""
    gen = _gen(seed)
    fp8 = dtype == "fp8"
    q_dtype, cache_dtype = (torch.bfloat16, FP8) if fp8 else (FLOATS[dtype], FLOATS[dtype])
    seq_lens = [1, 0, 37, 130, 300] if mode == "decode" else [5, 0, 40, 129, 300]
    q_lens = [1, 0, 1, 1, 1] if mode == "decode" else [5, 0, 16, 1, 64]
    seq_lens, q_lens = lens or (seq_lens, q_lens)
    need = [-(-n // bs) for n in seq_lens]
    pages = sum(need) + 3
    perm = torch.randperm(pages, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(need) + 2), -1, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[nxt:nxt + n], dtype=torch.int32)
        nxt += n
    shape = (pages, h_kv, bs, d) if layout == "HND" else (pages, bs, h_kv, d)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float32).to(cache_dtype)
    v_cache = k_cache.clone()
    k_nhd, v_nhd = (k_cache.transpose(1, 2), v_cache.transpose(1, 2)) if layout == "HND" else (k_cache, v_cache)
    k_scale = v_scale = None
    if fp8:
        k_scale, v_scale = torch.rand(h_kv, generator=gen) * 0.02 + 0.01, torch.rand(h_kv, generator=gen) * 0.02 + 0.01
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n)
        blk, row = table[b, pos // bs].long(), pos % bs
        kt, vt = _randn((n, h_kv, d), gen), _randn((n, h_kv, d), gen)
        if fp8:
            kt, vt = (kt / k_scale[:, None]).clamp(-448, 448), (vt / v_scale[:, None]).clamp(-448, 448)
        k_nhd[blk, row], v_nhd[blk, row] = kt.to(cache_dtype), vt.to(cache_dtype)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    args = dict(q=_randn((int(cu[-1]), h_kv * group, d), gen, q_dtype), k_cache=k_cache, v_cache=v_cache,
                cu_seqlens_q=cu, seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table)
    extra = dict(k_scale=k_scale, v_scale=v_scale, kv_layout=layout, max_seqlen_q=max(q_lens))
    to = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return {k: to(v) for k, v in args.items()}, {k: to(v) for k, v in extra.items()}, seq_lens, q_lens


def feature_options(flags: tuple[str, ...], h_q: int, seq_lens, q_lens, gen) -> dict:
    """kvops.paged_attention keyword arguments for ``flags`` (flags: causal is on unless ``right``)."""
    o: dict = dict(causal="right" not in flags)
    if "window" in flags or "sink_tokens" in flags or "right" in flags:
        o["window_left"] = 32
    if "softcap" in flags:
        o["softcap"] = 2.0
    if "sinks" in flags:
        o["sinks"] = torch.randn(h_q, generator=gen)
    if "alibi" in flags:
        o["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (h + 1) / h_q) for h in range(h_q)])
    if "leftpad" in flags:
        pads = [min(p, max(0, n - q)) for p, n, q in zip((0, 0, 3, 7, 20), seq_lens, q_lens)]
        o["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32)
    if "sink_tokens" in flags:
        o["sink_tokens"] = 4
    if "rope" in flags:
        o["rope_theta"] = 10000.0
    if "right" in flags:
        o["window_right"] = 8
    return o


# --- checks --------------------------------------------------------------------------------------------------------
def _err(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> tuple[bool, float]:
    """(every element within atol + rtol * |want|, the largest |got - want|); NaN never passes."""
    got, want = got.to("cpu", F64), want.to("cpu", F64)
    if got.shape != want.shape:
        return False, math.inf
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite) or not torch.equal(torch.isneginf(got), torch.isneginf(want)):
        return False, math.inf
    diff = (got[finite] - want[finite]).abs()
    ok = bool((diff <= atol + rtol * want[finite].abs()).all())
    return ok, float(diff.max()) if diff.numel() else 0.0


def check_attention(device, dtype, d, group, bs, layout, mode, flags, seed):
    import kvops

    args, extra, seq_lens, q_lens = paged_inputs(device, dtype, d, group, bs, layout, mode, seed)
    h_q = args["q"].shape[1]
    opts = {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
            for k, v in feature_options(flags, h_q, seq_lens, q_lens, _gen(seed + 1)).items()}
    out, lse = kvops.paged_attention(**args, max_seqlen_q=extra["max_seqlen_q"], return_lse=True,
                                     kv_layout=extra["kv_layout"], k_scale=extra["k_scale"],
                                     v_scale=extra["v_scale"], **opts)
    nhd = (lambda c: c.transpose(1, 2)) if layout == "HND" else (lambda c: c)  # noqa: E731
    want, want_lse = attention_oracle(args["q"], nhd(args["k_cache"]), nhd(args["v_cache"]), args["cu_seqlens_q"],
                                      args["seq_lens"], args["block_table"], k_scale=extra["k_scale"],
                                      v_scale=extra["v_scale"], **opts)
    atol, rtol = TOL[args["q"].dtype]
    ok_out, e_out = _err(out, want, atol, rtol)
    ok_lse, e_lse = _err(lse, want_lse, LSE_TOL, LSE_TOL)
    return ok_out and ok_lse, f"max |out - fp64| {e_out:.2e}, |lse - fp64| {e_lse:.2e}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _random_bits(shape, dtype, gen) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, infinities, subnormals): a kernel writing a wrong row shows."""
    bits = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=gen)
    return bits.view(dtype).view(shape)


def _both(device, fn, *tensors):
    """``fn`` on CPU copies and on ``device`` copies of ``tensors``; returns (cpu tensors, device tensors) after."""
    cpu = [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors]
    dev = [t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors]
    fn(*cpu)
    fn(*dev)
    return cpu, dev


def check_paged_write(device, dtype, d, bs, layout, seed, rotary=None):
    import kvops

    gen = _gen(seed)
    fp8 = dtype == "fp8"
    src, cache_dtype = (torch.bfloat16, FP8) if fp8 else (FLOATS[dtype], FLOATS[dtype])
    n, h_kv, h_in, pages = 37, 4, 2, -(-64 // bs) + 2
    shape = (pages, h_kv, bs, d) if layout == "HND" else (pages, bs, h_kv, d)
    k_cache, v_cache = _random_bits(shape, cache_dtype, gen), _random_bits(shape, cache_dtype, gen)
    key, value = _randn((n + 3, h_in, d), gen, src), _randn((n + 3, h_in, d), gen, src)
    slots = torch.randperm(pages * bs, generator=gen)[:n]
    slots[::5] = -1  # skipped tokens
    scales = (torch.rand(h_kv, generator=gen) * 0.05 + 0.01, torch.rand(h_kv, generator=gen) * 0.05 + 0.01) \
        if fp8 else (None, None)
    if rotary is None:
        def fn(kk, vv, kc, vc, sl, ks, vs):
            kvops.paged_cache_write(kk, vv, kc, vc, sl, 1, ks, vs, kv_layout=layout)
        cpu, dev = _both(device, fn, key, value, k_cache, v_cache, slots, *scales)
        ok = _same_bits(cpu[2], dev[2]) and _same_bits(cpu[3], dev[3])
        return ok, "bit-exact vs the CPU kernel" if ok else "differs from the CPU kernel"
    rot = d // 2 if rotary == "partial" else d
    ang = torch.arange(512, dtype=torch.float32)[:, None] * 10000.0 ** (-torch.arange(rot // 2) * 2.0 / rot)
    positions = torch.randint(0, 512, (n + 3,), generator=gen)

    def fn(kk, vv, kc, vc, sl, pos, cos, sin, ks, vs):
        kvops.rotary_paged_cache_write(kk, vv, kc, vc, sl, pos, cos, sin, rotary == "gptj", 1, ks, vs)
    cpu, dev = _both(device, fn, key, value, k_cache, v_cache, slots, positions, ang.cos().to(src), ang.sin().to(src),
                     *scales)
    ok_v = _same_bits(cpu[3], dev[3])
    got, want = dev[2].cpu().to(torch.float32), cpu[2].to(torch.float32)
    same = _same_bits(cpu[2], dev[2])
    # fp32 math rounded once to the key's dtype: at most one rounding apart (two codes for fp8)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}.get(src, 0) * (4 if fp8 else 1)
    close = bool(((got - want).abs() <= tol * (want.abs() + 1) * (1 if not fp8 else 448)).all()) or same
    nan_ok = torch.equal(got.isnan(), want.isnan())
    return ok_v and close and nan_ok, "bit-exact" if same else "key within one rounding of the CPU kernel"


def check_cache_write(device, dtype, d, seed):
    import kvops

    gen = _gen(seed)
    k_cache, v_cache = _random_bits((2, 96, 4, d), FLOATS[dtype], gen), _random_bits((2, 96, 4, d), FLOATS[dtype], gen)
    key, value = _randn((2, 33, 2, d), gen, FLOATS[dtype]), _randn((2, 33, 2, d), gen, FLOATS[dtype])
    cpu, dev = _both(device, lambda k, v, kc, vc: kvops.cache_write(k, v, kc, vc, start=17, cache_head_start=1),
                     key, value, k_cache, v_cache)
    ok = _same_bits(cpu[2], dev[2]) and _same_bits(cpu[3], dev[3])
    return ok, "bit-exact vs the CPU kernel" if ok else "differs from the CPU kernel"


def check_transfer(device, dtype, d, bs, seed):
    import kvops

    gen = _gen(seed)
    cache_dtype = FP8 if dtype == "fp8" else FLOATS[dtype]
    layers, h_kv, h, n = 2, 4, 2, 40
    pages = -(-(n + 5) // bs) + 4
    caches = [_random_bits((pages, bs, h_kv, d), cache_dtype, gen) for _ in range(2 * layers)]
    table = torch.randperm(pages, generator=gen)[: -(-(n + 5) // bs)].to(torch.int32)
    staging = torch.zeros((2, layers, n, h, d), dtype=cache_dtype)

    def gather(st, t, *cs):
        kvops.paged_kv_gather(cs[:layers], cs[layers:], t, st, start=5, cache_head_start=1)
    cpu, dev = _both(device, gather, staging, table, *caches)
    ok = _same_bits(cpu[0], dev[0])
    new = _random_bits(staging.shape, cache_dtype, gen)

    def scatter(st, t, *cs):
        kvops.paged_kv_scatter(st, cs[:layers], cs[layers:], t, start=5, cache_head_start=2)
    cpu, dev = _both(device, scatter, new, table, *caches)
    ok = ok and all(_same_bits(a, b) for a, b in zip(cpu[2:], dev[2:]))
    return ok, "gather and scatter bit-exact vs the CPU kernel" if ok else "differs from the CPU kernel"


def check_packed(device, fmt, dtype, d, group, t, seed):
    """quantize (the CPU kernel's codes bit for bit), dequantize (within fp32 rounding) and attention (fp64)."""
    from kvops.packed import packed_attention
    from kvops.ops.packed import dequantize_kv, quantize_kv

    gen = _gen(seed)
    b, n, h_kv = 2, 96, 2
    k, v = _randn((b, n, h_kv, d), gen, FLOATS[dtype]), _randn((b, n, h_kv, d), gen, FLOATS[dtype])
    gs = {} if fmt in ("int8", "fp8") else {"group_size": 32}
    pk, pv = quantize_kv(k.to(device), fmt, **gs), quantize_kv(v.to(device), fmt, **gs)
    def on_cpu(p):
        return p._replace(**{f: getattr(p, f).cpu() for f in p._fields[1:] if getattr(p, f) is not None})

    dk, dk_cpu = dequantize_kv(pk, torch.float32), dequantize_kv(on_cpu(pk), torch.float32)
    dv_cpu = dequantize_kv(on_cpu(pv), torch.float32)
    ok_deq = bool(torch.allclose(dk.cpu(), dk_cpu, rtol=1e-6, atol=1e-6))  # fp32 rounding (tests/packed/test_packed_triton)
    ok_q = all(a is None and b is None or a is not None and b is not None and torch.equal(a.cpu(), b)
               for a, b in zip(pk[1:], quantize_kv(k, fmt, **gs)[1:]))  # the CPU kernel's codes, bit for bit
    q = _randn((b, t, h_kv * group, d), gen, FLOATS[dtype])
    dense = _randn((b, 24, h_kv, d), gen, FLOATS[dtype])
    counts = torch.randint(0, 3, (24 + n,), generator=gen, dtype=torch.int32)
    out, lse = packed_attention(q.to(device), [dense.to(device), pk], [dense.to(device), pv],
                                row_counts=counts.to(device), return_lse=True)
    kk = torch.cat((dense.to(F64), dk_cpu.to(F64)), 1).repeat_interleave(group, 2)
    vv = torch.cat((dense.to(F64), dv_cpu.to(F64)), 1).repeat_interleave(group, 2)
    s = torch.einsum("bthd,bnhd->bhtn", q.to(F64), kk) * d ** -0.5 + counts.to(F64).log()  # weight = count
    want_lse = torch.logsumexp(s, -1)
    want = torch.einsum("bhtn,bnhd->bthd", torch.softmax(s, -1), vv)
    ok_o, e_o = _err(out, want, *TOL[FLOATS[dtype]])
    lse_tol = TOL[FLOATS[dtype]] if dtype != "fp32" else (LSE_TOL, LSE_TOL)  # K/V are rounded to q's dtype
    ok_l, e_l = _err(lse, want_lse, *lse_tol)
    ok = ok_deq and ok_q and ok_o and ok_l
    return ok, (f"codes {'=' if ok_q else '!='} CPU kernel's, dequantized {'within' if ok_deq else 'NOT within'} 1e-6; "
                f"attention max |out - fp64| {e_o:.2e}, |lse - fp64| {e_l:.2e}")


def check_mla(device, dtype, bs, mode, seed):
    """``kvops.ops.mla.mla_attention`` at DeepSeek's widths (rank 512 + rope 64, 16 heads: one head block) against
    :func:`attention_oracle` over the latent rows as one KV head (values: their first 512 columns)."""
    from kvops.ops.mla import mla_attention

    gen, fp8 = _gen(seed), dtype == "fp8"
    q_dtype = torch.bfloat16 if fp8 else FLOATS[dtype]
    rank, width, heads = 512, 576, 16
    seq_lens = [1, 77, 300, 0, 5]
    q_lens = [1, 1, 1, 0, 1] if mode == "decode" else [1, 20, 300, 0, 8]  # 8 > 5: causal positions below 0
    blocks = [-(-n // bs) for n in seq_lens]
    pages = sum(blocks) + 2
    perm = torch.randperm(pages, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(blocks) + 1), -1, dtype=torch.int32)
    cache = torch.full((pages, bs, width), math.nan)
    for b, nb in enumerate(blocks):
        for j in range(nb):
            table[b, j] = perm.pop()
            rows = min(bs, seq_lens[b] - j * bs)
            cache[table[b, j], :rows] = torch.randn(rows, width, generator=gen)
    kv_scale = torch.tensor(0.02) if fp8 else None
    cache = ((cache / kv_scale).clamp(-448, 448) if fp8 else cache).to(FP8 if fp8 else q_dtype)
    q = _randn((sum(q_lens) + 1, heads, width), gen, q_dtype)  # one row past cu_seqlens_q[-1]
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    dev = [t.to(device) for t in (q, cache, cu, lens, table)]
    out, lse = mla_attention(*dev, max(q_lens), rank, kv_scale=None if kv_scale is None else kv_scale.to(device))
    c4 = cache.unsqueeze(2)
    sc = None if kv_scale is None else kv_scale.reshape(1)
    want, want_lse = attention_oracle(q, c4, c4[..., :rank], cu, lens, table, scale=width ** -0.5, k_scale=sc,
                                      v_scale=sc)
    atol, rtol = TOL[q_dtype]
    ok_out, e_out = _err(out, want, atol, rtol)
    ok_lse, e_lse = _err(lse, want_lse, LSE_TOL, LSE_TOL)
    return ok_out and ok_lse, f"max |out - fp64| {e_out:.2e}, |lse - fp64| {e_lse:.2e}"


def check_mla_write(device, dtype, bs, rotary, seed):
    """``kvops.ops.mla.mla_cache_write`` on ``device`` against the CPU kernel on the same inputs: bit for bit, the
    rotated ``k_pe`` within one rounding of its dtype (two fp8 codes)."""
    from kvops.ops.mla import mla_cache_write

    gen, fp8 = _gen(seed), dtype == "fp8"
    src = torch.bfloat16 if fp8 else FLOATS[dtype]
    n, rank, rope, pages = 37, 512, 64, -(-64 // bs) + 2
    cache = _random_bits((pages, bs, rank + rope), FP8 if fp8 else src, gen)
    kv_c, k_pe = _randn((n + 3, rank), gen, src), _randn((n + 3, rope), gen, src)
    slots = torch.randperm(pages * bs, generator=gen)[:n]
    slots[::5] = -1
    scale = torch.tensor(0.01) if fp8 else None
    rot = (None, None, None)
    if rotary is not None:
        ang = torch.arange(512, dtype=torch.float32)[:, None] * 10000.0 ** (-torch.arange(rope // 2) * 2.0 / rope)
        rot = (torch.randint(0, 512, (n + 3,), generator=gen), ang.cos().to(src), ang.sin().to(src))

    def fn(c, p, kc, sl, ks, pos, cos, sin):
        mla_cache_write(c, p, kc, sl, ks, pos, cos, sin, rotary == "gptj")
    cpu, dev = _both(device, fn, kv_c, k_pe, cache, slots, scale, *rot)
    same = _same_bits(cpu[2], dev[2])
    got, want = dev[2].cpu().to(torch.float32), cpu[2].to(torch.float32)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[src] * (4 if fp8 else 1)
    fin = ~want.isnan()
    close = bool(((got[fin] - want[fin]).abs() <= tol * (want[fin].abs() + 1) * (448 if fp8 else 1)).all())
    ok = same or (rotary is not None and close and _same_bits(cpu[2][..., :rank], dev[2][..., :rank])
                  and torch.equal(got.isnan(), want.isnan()))
    return ok, "bit-exact" if same else "k_pe within one rounding of the CPU kernel" if ok else "differs"


# --- the sweep -----------------------------------------------------------------------------------------------------
def attention_cases():
    """Every (dtype, head dim, mode) with no flags and with causal/window/softcap/sinks, GQA group, block size and
    layout turning with it; each feature alone and all together per head dim; the GQA x block size square."""
    rot = itertools.count()
    base = ("window", "softcap", "sinks")
    for flags in ((), base):
        for dtype, d, mode in itertools.product((*FLOATS, "fp8"), HEAD_DIMS, ("decode", "prefill")):
            i = next(rot)
            yield ("attention", dtype, d, GROUPS[i % 4], BLOCK_SIZES[i % 3], ("NHD", "HND")[i % 2], mode, flags)
    for name, mode in itertools.product(FEATURES, ("decode", "prefill")):
        if name != "right" or mode == "prefill":
            yield ("attention", "bf16", 128, 4, 16, "NHD", mode, (name,))
    for d, mode, dtype in itertools.product(HEAD_DIMS, ("decode", "prefill"), ("bf16", "fp8")):
        yield ("attention", dtype, d, 8, 16, "NHD", mode, (*base, "alibi", "leftpad", "sink_tokens", "rope"))
    for group, bs in itertools.product(GROUPS, BLOCK_SIZES):
        yield ("attention", "fp16", 64, group, bs, "HND", "decode", ())


def movement_cases():
    """The data-movement and packed families, round-robin (each family's first case comes early)."""
    writes, rotary, transfer, contiguous = [], [], [], []
    for k, (dtype, d) in enumerate(itertools.product((*FLOATS, "fp8"), HEAD_DIMS)):
        writes.append(("paged_write", dtype, d, BLOCK_SIZES[k % 3], ("NHD", "HND")[k % 2]))
        rotary.append(("rotary_write", dtype, d, BLOCK_SIZES[(k + 1) % 3], ("neox", "gptj", "partial")[k % 3]))
        transfer.append(("transfer", dtype, d, BLOCK_SIZES[k % 3]))
        if dtype != "fp8":
            contiguous.append(("cache_write", dtype, d))
    # 12 distinct (format, dtype, head dim) triples, each with a GQA group and a query length
    packed = [("packed", fmt, dtype, d, group, (1, 16)[group % 2]) for _, fmt, dtype, d, group in zip(
        range(24), itertools.cycle(("int8", "fp8", "int4", "int2")), itertools.cycle(FLOATS),
        itertools.cycle(HEAD_DIMS), itertools.cycle((1, 4, 8)))]
    # MLA (kvops/ops/mla.py): attention per (dtype, mode), block sizes 1/16/64 turning; the write per dtype
    mla = [("mla", dtype, BLOCK_SIZES[k % 3], mode)
           for k, (mode, dtype) in enumerate(itertools.product(("decode", "prefill"), (*FLOATS, "fp8")))]
    mla_write = [("mla_write", dtype, BLOCK_SIZES[k % 3], (None, "neox", "gptj")[k % 3])
                 for k, dtype in enumerate((*FLOATS, "fp8"))]
    for group in itertools.zip_longest(writes, rotary, transfer, contiguous, packed, mla, mla_write):
        yield from (c for c in group if c is not None)


def cases():
    """Attention and data-movement cases interleaved (a deadline still leaves every kernel called)."""
    for a, m in itertools.zip_longest(attention_cases(), movement_cases()):
        yield from (c for c in (a, m) if c is not None)


def label(case) -> str:
    kind, *rest = case
    if kind == "attention":
        dtype, d, group, bs, layout, mode, flags = rest
        return f"{mode} {dtype} D={d} G={group} bs={bs} {layout} flags={','.join(flags) or '-'}"
    return f"{kind} " + " ".join(str(x) for x in rest if x is not None)


def run_case(case, device, seed: int):
    kind, *rest = case
    fn = dict(attention=check_attention, paged_write=check_paged_write, transfer=check_transfer,
              cache_write=check_cache_write, packed=check_packed, mla=check_mla, mla_write=check_mla_write,
              rotary_write=lambda dev, dtype, d, bs, rot, seed: check_paged_write(dev, dtype, d, bs, "NHD", seed,
                                                                                  rotary=rot))[kind]
    return fn(device, *rest, seed)


def sweep(device, deadline: float, on_row=None, limit: int | None = None, only: str = ""):
    """Run :func:`cases` (the first ``limit``; those whose label contains ``only``) on ``device`` until
    ``deadline`` (``time.monotonic()``); returns rows ``{case, status, seconds, detail}``; ``on_row`` sees each."""
    rows = []
    for i, case in enumerate(c for c in cases() if only in label(c)):
        if limit is not None and i >= limit:
            break
        if time.monotonic() > deadline:
            break
        t0 = time.perf_counter()
        try:
            ok, detail = run_case(case, device, seed=1000 + i)
            status = "ok" if ok else "FAIL"
        except Exception as e:  # a refused or crashing case is a result of the sweep
            status, detail = "ERROR", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        if device != "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()
        row = dict(case=label(case), status=status, seconds=round(time.perf_counter() - t0, 3), detail=detail)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows

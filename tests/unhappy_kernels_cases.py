"""Adversarial cases for the ops and kernels (the ``kernels`` source of ``python -m tests.unhappy
--report``; ``tests/errors/test_unhappy_ops.py`` requires every one to be clear).

Classes: sizes near the integer limits (KV lengths near 2^31 in the native and Triton kernels, windows and sink counts
of ``sys.maxsize``, integers past 64 bits, FlashInfer plans past int32, caches past the addressable bytes, huge
k-means and stage counts), non-finite scalars (``scale``, ``softcap``, RoPE, FlashInfer's scales, ALiBi slopes) and
non-finite data (a NaN in a visible key or in q must give NaN, hidden NaN/inf never reaches the output, quantized
NaN/inf stays visible), and the value-check mode under threads. A case either must raise (``exc``, ``needles``) or
must return a result its ``check`` accepts (``exc=None``); some accept both (refusing clearly, or a right result).
"""

from __future__ import annotations

import sys

import torch

from tests.unhappy import Case

I32 = torch.int32
NAN, INF = float("nan"), float("inf")
BIG = 2**63


def _t(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


def _pa_args(**over):
    a = dict(q=_t(3, 4, 8), k_cache=_t(4, 4, 2, 8), v_cache=_t(4, 4, 2, 8),
             cu_seqlens_q=torch.tensor([0, 1, 3], dtype=I32), seq_lens=torch.tensor([3, 6], dtype=I32),
             block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32), max_seqlen_q=2)
    a.update(over)
    return a


def _close(want_kw=None, tol=1e-5):
    """A check: the result equals the fp64 reference of ``kvops/reference/attention.py`` (with ``want_kw``)."""
    def check(result, a):
        from kvops.reference.attention import reference

        out = result[0] if isinstance(result, tuple) else result
        kw = {k: v for k, v in a.items() if k not in ("q", "k_cache", "v_cache", "cu_seqlens_q", "seq_lens",
                                                       "block_table", "max_seqlen_q")}
        want = reference(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"], a["block_table"],
                         **(kw if want_kw is None else want_kw))[0]
        err = float((out.double() - want).abs().max())
        return None if err < tol else f"off by {err:.3g} from the reference"
    return check


def _case(name, fn, make, exc=None, needles=(), check=None, mode=None, timeout=None):
    """A Case calling ``fn(make())``; ``check(result, args)`` (None: right) for calls that must succeed."""
    case = Case(name, None, exc, needles, mode=mode, timeout=timeout)

    def build():
        a = make()
        if check is not None:
            case.check = lambda result: check(result, a)
        return (lambda: fn(a)), a
    case.build = build
    case.check = check and (lambda result: "not built")
    return case


def _pa(a):
    import kvops
    return kvops.paged_attention(**a)


# --- sizes near the integer limits -----------------------------------------------------------------------------
def _limit_cases():
    from tests.errors.test_unhappy_limits import near_limit_cases, near_limit_inputs

    out = []
    for name, seq_len, q_len, kw in near_limit_cases():
        def make(seq_len=seq_len, q_len=q_len, kw=kw):
            args, feats = near_limit_inputs(seq_len, q_len, kw)
            return dict(zip(("q", "k_cache", "v_cache", "cu_seqlens_q", "seq_lens", "block_table"), args),
                        max_seqlen_q=q_len, **feats)
        out.append(_case(f"paged_attention native: seq_len near 2^31, {name}", _pa, make, check=_close()))

        def triton(a):
            from kvops._checks.features import AttnFeatures
            from kvops.triton.paged_attention import paged_attention as launch
            feats = {k: a[k] for k in ("alibi_slopes", "window_right", "cache_leftpad", "sink_tokens") if k in a}
            return launch(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"], a["block_table"],
                          a["max_seqlen_q"], 8 ** -0.5, a.get("causal", True), a.get("window_left", -1), 0.0, None,
                          None, None, AttnFeatures(**feats))

        def make_t(make=make):  # (RoPE: Triton's fp32 angles are exact to ~2^24, not 2^31)
            a = make()
            a.pop("rope_theta", None)
            return a
        out.append(_case(f"triton paged_attention: seq_len near 2^31, {name}", triton, make_t, check=_close()))
    # windows and sink counts of sys.maxsize and past 64 bits: unbounded, in every backend
    for what, kw, plain in (("window_right=sys.maxsize, causal=False", dict(causal=False, window_right=sys.maxsize),
                             dict(causal=False)),
                            ("window_right=2**64, causal=False", dict(causal=False, window_right=2**64),
                             dict(causal=False)),
                            ("window_left=sys.maxsize", dict(window_left=sys.maxsize), {}),
                            ("window_left=2**63", dict(window_left=BIG), {}),
                            ("sink_tokens=sys.maxsize + cache_leftpad", dict(window_left=1, sink_tokens=sys.maxsize,
                                                                             cache_leftpad=torch.tensor([1, 2], dtype=I32)),
                             dict(cache_leftpad=torch.tensor([1, 2], dtype=I32))),
                            ("sink_tokens=2**63, window 0", dict(window_left=0, sink_tokens=BIG), {})):
        out.append(_case(f"paged_attention: {what} is unbounded", _pa, lambda kw=kw: _pa_args(**kw),
                         check=_close(plain)))
        out.append(_case(f"paged_attention composite: {what} is unbounded", _composite,
                         lambda kw=kw: _pa_args(**kw), check=_close(plain)))

    def fa_max(a):
        import kvops
        return kvops.flash_attn_with_kvcache(**a)

    def fa_make():
        return dict(q=_t(2, 1, 4, 8), k_cache=_t(2, 8, 2, 8), v_cache=_t(2, 8, 2, 8),
                    cache_seqlens=torch.tensor([5, 8], dtype=I32), causal=False, window_size=(-1, sys.maxsize))

    def fa_check(result, a):
        import kvops
        want = kvops.flash_attn_with_kvcache(a["q"], a["k_cache"], a["v_cache"], cache_seqlens=a["cache_seqlens"],
                                             causal=False)
        return None if torch.equal(result, want) else "differs from window_size=(-1, -1)"
    out.append(_case("flash_attn_with_kvcache: window_size=(-1, sys.maxsize)", fa_max, fa_make, check=fa_check))
    # integers past 64 bits: a ValueError naming the argument (torch's own error gives no fix)
    import kvops
    for what, fn, make, name in (
        ("kvops.paged_attention", _pa, lambda: _pa_args(max_seqlen_q=BIG), "max_seqlen_q"),
        ("kvops.cache_write", lambda a: kvops.cache_write(**a), lambda: dict(
            key=_t(1, 2, 2, 8), value=_t(1, 2, 2, 8), k_cache=_t(1, 8, 2, 8), v_cache=_t(1, 8, 2, 8), start=BIG),
         "start"),
        ("kvops.cache_roll", lambda a: kvops.cache_roll(**a), lambda: dict(
            k_cache=_t(1, 8, 2, 8), v_cache=_t(1, 8, 2, 8), src=2, dst=BIG, num_tokens=2), "dst"),
        ("kvops.paged_kv_gather", lambda a: kvops.paged_kv_gather(**a), lambda: dict(
            k_caches=[_t(4, 4, 2, 8)], v_caches=[_t(4, 4, 2, 8)], block_table=torch.tensor([0, 2]),
            staging=_t(2, 1, 6, 2, 8), start=BIG), "start"),
        ("kvops.paged_kv_scatter", lambda a: kvops.paged_kv_scatter(**a), lambda: dict(
            staging=_t(2, 1, 6, 2, 8), k_caches=[_t(4, 4, 2, 8)], v_caches=[_t(4, 4, 2, 8)],
            block_table=torch.tensor([0, 2]), cache_head_start=-BIG - 1), "cache_head_start"),
    ):
        out.append(_case(f"{what}: {name} past 64 bits", fn, make, ValueError, [what, name, "does not fit in 64 bits"]))
    # FlashInfer plan past int32 kv_len (wrapped to 3 keys), caches past the addressable bytes, huge packed sizes
    out.append(_case("FlashInfer plan: 4097 pages of 2^20 tokens", _fi_plan, lambda: dict(
        indptr=torch.tensor([0, 4097], dtype=I32), indices=torch.zeros(4097, dtype=I32),
        last_page_len=torch.tensor([3], dtype=I32), num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=2**20),
        ValueError, ["kv_len = 4294967299", "int32"]))
    from kvops.cache import PackedCausalKVCache, PagedKVCache, RingCausalKVCache, RollingKVCache
    for what, make, needle in (
        ("PagedKVCache", lambda: PagedKVCache(2**40, 16, 8, 128, num_layers=2), "num_blocks=1099511627776"),
        ("PagedKVCache", lambda: PagedKVCache(2**63, 16, 8, 128), "num_blocks=9223372036854775808"),
        ("CausalKVCache.allocate", lambda: kvops.CausalKVCache.allocate(1, 2**62, 8, 128), "cache_size="),
        ("RingCausalKVCache.allocate", lambda: RingCausalKVCache.allocate(2, 2**50, 8, 128), "cache_size="),
        ("RollingKVCache.allocate", lambda: RollingKVCache.allocate(1, 2**50, 8, 128), "window_size="),
        ("PackedCausalKVCache", lambda: PackedCausalKVCache.allocate(1, 2**50, 8, 128, chunk_tokens=4,
                                                                     quant="int4"), "cache_size="),
    ):
        out.append(Case(f"{what}: buffers past the addressable bytes ({needle})", lambda make=make: (make, ()),
                        ValueError, [what, needle, "bytes"]))
    import kvops.packed as kp
    for what, kw, needle in (("kmeans_iters=2**40 (ran for hours)", dict(kmeans_iters=2**40), "kmeans_iters"),
                             ("stages=2**40", dict(stages=2**40), "stages=1099511627776")):
        out.append(_case(f"quantize_kv[int2]: {what}", lambda a, kw=kw: kp.quantize_kv(a["x"], "int2", **kw),
                         lambda: dict(x=_t(1, 16, 2, 16)), ValueError, [needle], timeout=120))
    return out


def _composite(a):
    from kvops._checks.features import AttnFeatures
    from kvops.cpu.paged_attention import paged_attention as composite

    feats = {k: a[k] for k in ("alibi_slopes", "window_right", "cache_leftpad", "sink_tokens", "rope_theta") if k in a}
    return composite(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"], a["block_table"],
                     a["max_seqlen_q"], 8 ** -0.5, a.get("causal", True), a.get("window_left", -1), 0.0, None, None,
                     None, AttnFeatures(**feats))


def _fi_plan(a):
    from kvops.integrations.flashinfer import BatchDecodeWithPagedKVCacheWrapper

    return BatchDecodeWithPagedKVCacheWrapper().plan(**a)


def _fi_run(plan_kw=None, run_kw=None):
    def fn(a):
        from kvops.integrations.flashinfer import BatchDecodeWithPagedKVCacheWrapper

        w = BatchDecodeWithPagedKVCacheWrapper()
        w.plan(a["indptr"], a["indices"], a["last_page_len"], 4, 2, 8, 4, q_data_type=torch.float32,
               **(plan_kw or {}))
        return w.run(a["q"], (a["k_cache"], a["v_cache"]), **(run_kw or {}))
    return fn


def _fi_args():
    return dict(indptr=torch.tensor([0, 1, 3], dtype=I32), indices=torch.tensor([0, 1, 2], dtype=I32),
                last_page_len=torch.tensor([2, 4], dtype=I32), q=_t(2, 4, 8), k_cache=_t(4, 4, 2, 8),
                v_cache=_t(4, 4, 2, 8))


# --- non-finite scalars and data ------------------------------------------------------------------------------------
def _nan_rows(rows, heads):
    def check(result, a=None):
        out, lse = result if isinstance(result, tuple) else (result, None)
        ok = bool(out[rows][:, heads].isnan().all()) and (lse is None or bool(lse[heads][:, rows].isnan().all()))
        return None if ok else "a visible NaN gave a number (the 0 / -inf of 'no keys'?)"
    return check


def _nonfinite_cases():
    import kvops
    import kvops.packed as kp

    out = []
    for name, kw in (("scale", dict(scale=NAN)), ("scale", dict(scale=INF)), ("scale", dict(scale=-INF)),
                     ("softcap", dict(softcap=NAN)), ("softcap", dict(softcap=INF)),
                     ("rope_theta", dict(rope_theta=INF)), ("rope_scale", dict(rope_theta=1e4, rope_scale=INF))):
        value = str(kw[name])
        out.append(_case(f"paged_attention: {name}={value}", _pa, lambda kw=kw: _pa_args(**kw), ValueError,
                         [name, "finite", value]))

    def fa(a):
        return kvops.flash_attn_with_kvcache(**a)

    def fa_args(**over):
        d = dict(q=_t(2, 1, 4, 8), k_cache=_t(4, 4, 2, 8), v_cache=_t(4, 4, 2, 8), k=_t(2, 1, 2, 8), v=_t(2, 1, 2, 8),
                 cache_seqlens=torch.tensor([2, 3], dtype=I32), block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32))
        d.update(over)
        return d
    out.append(_case("flash_attn_with_kvcache: softmax_scale=nan (before appending)", fa,
                     lambda: fa_args(softmax_scale=NAN), ValueError, ["scale", "nan"]))
    out.append(_case("flash_attn_with_kvcache: softcap=inf (before appending)", fa, lambda: fa_args(softcap=INF),
                     ValueError, ["softcap", "inf"]))
    for mode in ("eager", "async"):
        out.append(_case(f"flash_attn_with_kvcache: alibi_slopes NaN [{mode}]", fa,
                         lambda: fa_args(alibi_slopes=torch.tensor([0.1, NAN, 0.2, 0.3])), RuntimeError,
                         ["alibi_slopes"], mode=mode))
    out.append(_case("packed_attention: scale=nan", lambda a: kp.packed_attention(a["q"], [a["k"]], [a["v"]],
                                                                                  scale=NAN),
                     lambda: dict(q=_t(1, 2, 4, 16), k=_t(1, 4, 2, 16), v=_t(1, 4, 2, 16)), ValueError,
                     ["scale", "nan"]))
    out.append(_case("FlashInfer plan: logits_soft_cap=nan", _fi_plan, lambda: dict(
        indptr=torch.tensor([0, 1], dtype=I32), indices=torch.zeros(1, dtype=I32),
        last_page_len=torch.tensor([1], dtype=I32), num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=4,
        logits_soft_cap=NAN), ValueError, ["logits_soft_cap", "nan"]))
    for name in ("q_scale", "k_scale", "v_scale"):
        out.append(_case(f"FlashInfer run: {name}=nan", _fi_run(run_kw={name: NAN}), _fi_args, ValueError,
                         [name, "nan"]))
    # ALiBi slopes: refused in the value-check modes; unchecked, NaN rows (never 0)
    for bad in (NAN, INF, -INF):
        for mode in ("eager", "async"):
            out.append(_case(f"paged_attention: alibi_slopes holds {bad} [{mode}]", _pa, lambda bad=bad: _pa_args(
                alibi_slopes=torch.tensor([0.1, 0.2, bad, 0.3])), RuntimeError, ["alibi_slopes"], mode=mode))
        out.append(_case(f"paged_attention: alibi_slopes holds {bad} [off] gives NaN rows", _pa,
                         lambda bad=bad: _pa_args(alibi_slopes=torch.tensor([0.1, 0.2, bad, 0.3])), mode="off",
                         check=_nan_rows([0, 1, 2], [2])))
    # NaN in a visible key / in q: NaN (as SDPA), in every kernel; hidden NaN never reaches the output
    def nan_key(a):
        a["k_cache"][2, 1, 1, 0] = NAN  # sequence 1's position 1, KV head 1: query heads 2, 3 of rows 1, 2
        return a
    for label, fn in (("native", _pa), ("composite", _composite), ("triton", _triton_pa)):
        out.append(_case(f"paged_attention {label}: NaN in a visible key gives NaN", fn,
                         lambda: nan_key(_pa_args()), check=_nan_rows([1, 2], [2, 3])))
        out.append(_case(f"paged_attention {label}: NaN q gives NaN", fn,
                         lambda: {**_pa_args(), "q": _pa_args()["q"].index_put((torch.tensor(0), torch.tensor(1)),
                                                                               torch.tensor(NAN))},
                         check=_nan_rows([0], [1])))

        def hidden(a):  # sequence 0: block 0 rows 0-2 (seq_len 3); sequence 1: blocks 2, 3 rows 0-1 (seq_len 6)
            for c, bad in ((a["k_cache"], NAN), (a["v_cache"], INF)):
                c[0, 3], c[1], c[3, 2:] = bad, bad, -bad  # past seq_len, and block 1 (never referenced)
            return a
        out.append(_case(f"paged_attention {label}: NaN/inf past seq_len never reaches the output", fn,
                         lambda: hidden(_pa_args()), check=_close()))
    # quantizing non-finite K/V keeps it visible (NaN), every format, CPU and Triton kernels
    for quant in kp.FORMATS:
        for kernel in ("cpu", "triton"):
            out.append(_case(f"quantize_kv[{quant}] ({kernel}): NaN and +-inf stay visible", _quant(quant, kernel),
                             lambda: dict(x=_t(1, 16, 2, 32)), check=_visible_nonfinite))
    out.append(Case("value_checks: two threads exit out of order; the process stays 'eager'", _threads, None,
                    check=lambda r: None if r == ("eager", "refused") else f"after the threads: {r}"))
    out[-1].build = _threads
    return out


def _triton_pa(a):
    from kvops.triton.paged_attention import paged_attention as launch

    return launch(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"], a["block_table"],
                  a["max_seqlen_q"], a.get("scale") or 8 ** -0.5, True, -1, 0.0, None, None, None)


def _quant(quant, kernel):
    def fn(a):
        import kvops.packed as kp
        from kvops.cpu import packed as reference
        from kvops.triton import packed_quant as triton_quant

        x = a["x"].clone()
        x[0, 3, 0, 5], x[0, 7, 1, 9], x[0, 9, 0, 1] = INF, NAN, -INF
        mod = reference if kernel == "cpu" else triton_quant
        p = kp.quantize_kv(torch.zeros_like(x), quant)
        mod.quantize(x, *p[1:], quant, 4)
        return mod.dequantize(*p[1:], quant, torch.float32)
    return fn


def _visible_nonfinite(got, a=None):
    if not all(bool(got[0, t, h, e].isnan()) for t, h, e in ((3, 0, 5), (7, 1, 9), (9, 0, 1))):
        return "a NaN or +-inf input dequantized to a number"
    return None if bool(torch.isfinite(got[0, 0]).all()) else "NaN spread to another token"


def _threads():
    """Two threads' value_checks blocks, exited out of order; then the mode and an over-capacity cache_seqlens."""
    import threading

    import kvops

    def build():
        a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

        def a():
            with kvops.value_checks("off"):
                a_in.set()
                b_in.wait(10)
            a_out.set()

        def b():
            a_in.wait(10)
            with kvops.value_checks("async"):
                b_in.set()
                a_out.wait(10)

        def call():
            ts = [threading.Thread(target=f) for f in (a, b)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(20)
            kc = torch.zeros(2, 4, 2, 8)
            try:
                kvops.flash_attn_with_kvcache(_t(1, 1, 2, 8), kc, kc.clone(), _t(1, 1, 2, 8), _t(1, 1, 2, 8),
                                              cache_seqlens=torch.tensor([9], dtype=I32),
                                              block_table=torch.tensor([[0, 1]], dtype=I32))
                verdict = "accepted"
            except RuntimeError:
                verdict = "refused"
            return kvops.get_value_checks(), verdict
        return call, ()
    return build()


def unhappy_cases() -> list[Case]:
    """Every case of this source, in a stable order."""
    return _limit_cases() + _nonfinite_cases() + _feature_cases()


# --- the attention features, FlashInfer and the packed ops through the generator of unhappy_ops_cases ------------
def _feature_cases():
    """Every tensor argument of feature calls (ALiBi, cache_leftpad, sinks, a right window, RoPE at read, FlashInfer
    plan/run) in another dtype, with an extra dim and on the meta device: a ValueError naming it."""
    import kvops

    from tests.unhappy_ops_cases import mutations

    bases = {
        "paged_attention[alibi, cache_leftpad, sinks, window, sink_tokens, rope]": (_pa, lambda: _pa_args(
            alibi_slopes=torch.full((4,), 0.1), cache_leftpad=torch.tensor([0, 1], dtype=I32), sinks=torch.zeros(4),
            window_left=3, sink_tokens=1, rope_theta=1e4)),
        "paged_attention[window_right, per-sequence alibi]": (_pa, lambda: _pa_args(
            causal=False, window_right=1, alibi_slopes=torch.full((2, 4), 0.1))),
        "flash_attn_with_kvcache[alibi, cache_leftpad, rotary]": (lambda a: kvops.flash_attn_with_kvcache(**a), lambda: dict(
            q=_t(2, 1, 4, 8), k_cache=_t(4, 4, 2, 8), v_cache=_t(4, 4, 2, 8), k=_t(2, 1, 2, 8), v=_t(2, 1, 2, 8),
            rotary_cos=_t(16, 4), rotary_sin=_t(16, 4), cache_seqlens=torch.tensor([2, 3], dtype=I32),
            cache_leftpad=torch.tensor([0, 1], dtype=I32), block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32),
            alibi_slopes=torch.full((4,), 0.1))),
        "FlashInfer run": (_fi_run(), _fi_args),
    }
    return [case for op, (fn, make) in bases.items() for case in mutations(op, fn, make)]

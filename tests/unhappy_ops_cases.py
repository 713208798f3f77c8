"""Generated unhappy-path cases for every public op (docs/semantics.md), and a runner that classifies their outcomes.

Each op has a valid base call (small shapes, the native CPU kernels where they exist); the generator derives invalid
calls from it: every tensor argument in another dtype, with an extra dim, on the meta device; every zero-size dim of
the caches; sizes that disagree; caches that overlap in memory; index values out of range. A case names the exception
type it must raise and the needles its message must contain (the argument's name, and the value where one is bad).

This is the ``ops`` source of the registry in ``tests/unhappy.py`` (``unhappy_cases()``), whose runner classifies
each case in a forked child (clear / unclear / changed-on-failure / silent-wrong / crash / hang):
``python -m tests.unhappy --report`` counts every source; ``python tests/unhappy_ops_cases.py [REPO] [-v]`` counts
this one, for the kvops checkout at REPO (default: this one), so the same cases can be run against another branch.
Imports only ``kvops``, torch and ``tests.unhappy``.
"""

from __future__ import annotations

import os
import sys

import torch

F = torch.float32
I32 = torch.int32
I64 = torch.int64


def _t(*shape, dtype=F, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    if dtype in (I32, I64, torch.uint8):
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=g).to(dtype)


if __name__ == "__main__":  # run as a script: the repository root (tests.unhappy) on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.unhappy import Case  # noqa: E402  (the registry's case record)


# --- base calls: (fn, args dict, names of the tensors it may mutate) -------------------------------------------------
def _base_calls():
    import kvops
    import kvops.export
    import kvops.packed as kp

    base = {}

    def cw():
        return dict(key=_t(1, 2, 2, 8), value=_t(1, 2, 2, 8), k_cache=_t(1, 8, 2, 8), v_cache=_t(1, 8, 2, 8), start=0)
    base["cache_write"] = (lambda a: kvops.cache_write(**a), cw)

    def cr():
        return dict(k_cache=_t(1, 8, 2, 8), v_cache=_t(1, 8, 2, 8), src=2, dst=0, num_tokens=2)
    base["cache_roll"] = (lambda a: kvops.cache_roll(**a), cr)

    def pw():
        return dict(key=_t(3, 2, 8), value=_t(3, 2, 8), k_cache=_t(4, 4, 2, 8), v_cache=_t(4, 4, 2, 8),
                    slot_mapping=torch.tensor([0, 5, 9]))
    base["paged_cache_write"] = (lambda a: kvops.paged_cache_write(**a), pw)

    def pa():
        return dict(q=_t(3, 4, 8), k_cache=_t(4, 4, 2, 8), v_cache=_t(4, 4, 2, 8),
                    cu_seqlens_q=torch.tensor([0, 1, 3], dtype=I32), seq_lens=torch.tensor([3, 6], dtype=I32),
                    block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32), max_seqlen_q=2)
    base["paged_attention"] = (lambda a: kvops.paged_attention(**a), pa)

    def fa():
        return dict(q=_t(2, 1, 4, 8), k_cache=_t(4, 4, 2, 8), v_cache=_t(4, 4, 2, 8), k=_t(2, 1, 2, 8),
                    v=_t(2, 1, 2, 8), cache_seqlens=torch.tensor([2, 3], dtype=I32),
                    block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32))
    base["flash_attn_with_kvcache"] = (lambda a: kvops.flash_attn_with_kvcache(**a), fa)

    def rw():
        d = pw()
        d.update(positions=torch.tensor([0, 1, 2]), rotary_cos=_t(16, 4), rotary_sin=_t(16, 4))
        return d
    base["rotary_paged_cache_write"] = (lambda a: kvops.rotary_paged_cache_write(**a), rw)

    def ar():
        return dict(x=_t(3, 2, 8), rotary_cos=_t(16, 4), rotary_sin=_t(16, 4), positions=torch.tensor([0, 1, 2]))
    base["apply_rotary"] = (lambda a: kvops.apply_rotary(**a), ar)

    def gather():
        return dict(k_caches=[_t(4, 4, 2, 8)], v_caches=[_t(4, 4, 2, 8)], block_table=torch.tensor([0, 2]),
                    staging=_t(2, 1, 6, 2, 8), start=1, cache_head_start=0)
    base["paged_kv_gather"] = (lambda a: kvops.paged_kv_gather(**a), gather)

    def scatter():
        return dict(staging=_t(2, 1, 6, 2, 8), k_caches=[_t(4, 4, 2, 8)], v_caches=[_t(4, 4, 2, 8)],
                    block_table=torch.tensor([0, 2]), start=1, cache_head_start=0)
    base["paged_kv_scatter"] = (lambda a: kvops.paged_kv_scatter(**a), scatter)

    for quant in kp.FORMATS:
        base[f"quantize_kv[{quant}]"] = (lambda a, quant=quant: kp.quantize_kv(a["x"], quant),
                                         lambda: dict(x=_t(1, 16, 2, 16)))

        def dq(quant=quant):
            p = kp.quantize_kv(_t(1, 16, 2, 16), quant)
            return dict(zip(p._fields[1:], p[1:]))
        base[f"dequantize_kv[{quant}]"] = (
            lambda a, quant=quant: kp.dequantize_kv(kp.PackedKV(quant, **a), torch.float32), dq)

    def pk():
        return dict(q=_t(1, 2, 4, 16), k=_t(1, 4, 2, 16), v=_t(1, 4, 2, 16))
    base["packed_attention"] = (lambda a: kp.packed_attention(a["q"], [a["k"]], [a["v"]]), pk)

    def su():
        return dict(key=_t(1, 2, 2, 8), value=_t(1, 2, 2, 8), k_cache=_t(1, 8, 2, 8), v_cache=_t(1, 8, 2, 8),
                    cursors=torch.tensor([4, 4]), current_chunk_start=torch.tensor(4))
    base["streaming_update"] = (lambda a: kvops.export.streaming_update(**a), su)

    def mg():
        return dict(o_a=_t(3, 4, 8), lse_a=_t(4, 3), o_b=_t(3, 4, 8), lse_b=_t(4, 3))
    base["merge_attention_states"] = (lambda a: kvops.merge_attention_states(**a), mg)

    def mgn():
        return dict(outs=_t(2, 3, 4, 8), lses=_t(2, 4, 3))
    base["merge_attention_states_many"] = (lambda a: kvops.merge_attention_states_many(**a), mgn)
    return base


_INDEX_NAMES = {"slot_mapping", "cu_seqlens_q", "seq_lens", "block_table", "positions", "cache_seqlens", "cursors",
                "current_chunk_start", "cluster_ids"}
_CACHE_NAMES = {"k_cache", "v_cache", "k_caches", "v_caches"}
_PACKED = {"codes", "scales", "zeros", "centroids", "cluster_ids"}


def _needle_name(name):
    return {"k_caches": "caches", "v_caches": "caches"}.get(name, name)


def mutations(op, fn, make) -> list[Case]:
    """Every tensor (or tensor list) argument of the base call ``fn(make())`` in another dtype, with an extra dim,
    and on the meta device: a ``ValueError`` naming it (and "meta")."""
    cases = []
    names = [n for n, v in make().items() if isinstance(v, torch.Tensor) or isinstance(v, list)]
    for name in names:
        for kind in ("dtype", "rank", "meta"):
            def mutate(a, name=name, kind=kind):
                v = a[name]
                one = v[0] if isinstance(v, list) else v
                if kind == "dtype":
                    if one.dtype in (I32, I64, torch.uint8, torch.int8):
                        new = one.float()
                    elif one.dtype == torch.float8_e4m3fn:
                        new = one.float()
                    else:
                        new = one.double()
                elif kind == "rank":
                    new = one.unsqueeze(0)
                else:
                    new = one.to("meta")
                a[name] = [new] if isinstance(v, list) else new
                return a
            exc = ValueError
            needles = [_needle_name(name)] if kind != "meta" else [_needle_name(name), "meta"]
            if op.startswith("dequantize_kv") or name in ("codes",):
                needles = [] if kind == "meta" else needles
            if kind == "meta" and len(names) == 1:
                continue  # the only tensor on meta: a valid meta call
            cases.append(_case(f"{op}: {name} {kind}", fn, make, mutate, exc, needles))
    return cases


def generate() -> list[Case]:
    """Every generated case, in a stable order."""
    cases = []
    for op, (fn, make) in _base_calls().items():
        cases += mutations(op, fn, make)
        # zero-size dims of the caches / inputs: a ValueError naming the dim, or a correct empty result (exc None)
        cases += _zero_cases(op, fn, make)
    cases += _value_cases()
    cases += _overlap_cases()
    cases += private_cases()
    return cases


PRIVATE_OPS = ("_paged_attention_native", "_paged_attention_values_bad", "_paged_write_native",
               "_packed_attention_native")


def private_cases() -> list[Case]:
    """``torch.ops.kvops._*`` called directly: they check what they address memory with."""
    ops = torch.ops.kvops
    out = []

    def add(name, make, needles, exc=RuntimeError):
        def build():
            a = make()
            return (lambda: getattr(ops, name)(*a)), a
        out.append(Case(f"torch.ops.kvops.{name}: {needles[-1]}", build, exc, [f"kvops::{name}", *needles]))

    def pw(h0=0, key=(3, 2, 8), cache=(4, 4, 2, 8), slots=(0, 5, 9)):
        return lambda: [_t(*key), _t(*key), _t(*cache), _t(*cache), torch.tensor(slots), h0, None, None]
    add("_paged_write_native", pw(h0=10**9), ["head slice"])
    add("_paged_write_native", pw(h0=-1), ["head slice"])
    add("_paged_write_native", pw(cache=(4, 0, 2, 8)), ["block_size"])
    add("_paged_write_native", pw(key=(3, 2, 16)), ["head_dim"])
    add("_paged_write_native", pw(key=(1, 2, 8)), ["one row per slot"])

    def pa(q=(3, 4, 8), cache=(4, 4, 2, 8), table=((0, 1), (2, 3)), cu=(0, 1, 3), lens=(3, 6), window=-1):
        return lambda: [_t(*q), _t(*cache), _t(*cache), torch.tensor(cu, dtype=I32), torch.tensor(lens, dtype=I32),
                        torch.tensor(table, dtype=I32), 2, 0.35, True, window, 0.0, None, None, None]
    add("_paged_attention_native", pa(cache=(4, 0, 2, 8), lens=(0, 0)), ["block_size"])
    add("_paged_attention_native", pa(q=(3, 3, 8)), ["num_kv_heads"])
    add("_paged_attention_native", pa(q=(3, 4, 16)), ["head_dim"])
    add("_paged_attention_native", pa(table=((0, 1),)), ["block_table"])
    add("_paged_attention_native", pa(window=-7), ["window_left"])

    def vb(block_size=4, table=((0, 1), (2, 3))):
        return lambda: [torch.tensor([0, 1, 3], dtype=I32), torch.tensor([3, 6], dtype=I32),
                        torch.tensor(table, dtype=I32), 3, 2, 4, block_size]
    add("_paged_attention_values_bad", vb(block_size=0), ["block_size"])
    add("_paged_attention_values_bad", vb(table=((0, 1),)), ["block_table"])

    def pk(q=(1, 2, 4, 16), k=(1, 4, 2, 16), v=(1, 4, 2, 16), counts=None):
        return lambda: [_t(*q), [_t(*k)], [_t(*v)], [], [], "", 0.25,
                        None if counts is None else torch.ones(counts, dtype=I32)]
    add("_packed_attention_native", pk(k=(1, 4, 3, 16), v=(1, 4, 3, 16)), ["num_kv_heads"])
    add("_packed_attention_native", pk(v=(1, 9, 2, 16)), ["should be"])
    add("_packed_attention_native", pk(k=(2, 4, 2, 16)), ["should be"])
    add("_packed_attention_native", pk(counts=100), ["row_counts"])
    return out


def _case(name, fn, make, mutate, exc, needles, mode=None):
    def build():
        a = mutate(make())
        return (lambda: fn(a)), a
    return Case(name, build, exc, needles, mode=mode)


def _zero_cases(op, fn, make):
    out = []
    shapes = {
        "paged_attention": [("block_size", dict(k_cache=(4, 0, 2, 8), v_cache=(4, 0, 2, 8))),
                            ("num_kv_heads", dict(q=(3, 0, 8), k_cache=(4, 4, 0, 8), v_cache=(4, 4, 0, 8))),
                            ("head_dim", dict(q=(3, 4, 0), k_cache=(4, 4, 2, 0), v_cache=(4, 4, 2, 0)))],
        "paged_cache_write": [("block_size", dict(k_cache=(4, 0, 2, 8), v_cache=(4, 0, 2, 8))),
                              ("num_kv_heads", dict(key=(3, 0, 8), value=(3, 0, 8), k_cache=(4, 4, 0, 8),
                                                    v_cache=(4, 4, 0, 8))),
                              ("head_dim", dict(key=(3, 2, 0), value=(3, 2, 0), k_cache=(4, 4, 2, 0),
                                                v_cache=(4, 4, 2, 0)))],
        "flash_attn_with_kvcache": [("block_size", dict(k_cache=(4, 0, 2, 8), v_cache=(4, 0, 2, 8))),
                                    ("num_kv_heads", dict(q=(2, 1, 0, 8), k=(2, 1, 0, 8), v=(2, 1, 0, 8),
                                                          k_cache=(4, 4, 0, 8), v_cache=(4, 4, 0, 8))),
                                    ("head_dim", dict(q=(2, 1, 4, 0), k=(2, 1, 2, 0), v=(2, 1, 2, 0),
                                                      k_cache=(4, 4, 2, 0), v_cache=(4, 4, 2, 0)))],
        "packed_attention": [("num_kv_heads", dict(q=(1, 2, 0, 16), k=(1, 4, 0, 16), v=(1, 4, 0, 16))),
                             ("head_dim", dict(q=(1, 2, 4, 0), k=(1, 4, 2, 0), v=(1, 4, 2, 0)))],
        "quantize_kv[fp8]": [("head_dim", dict(x=(1, 16, 2, 0)))],
        "quantize_kv[int8]": [("head_dim", dict(x=(1, 16, 2, 0)))],
    }
    for what, new in shapes.get(op, []):
        def mutate(a, new=new):
            for name, shape in new.items():
                a[name] = _t(*shape, dtype=a[name].dtype)
            return a
        out.append(_case(f"{op}: {what} = 0", fn, make, mutate, ValueError, [what, "0"]))
    if op == "flash_attn_with_kvcache":  # an empty contiguous cache
        def empty(a):
            return dict(q=_t(1, 1, 2, 8), k_cache=_t(1, 0, 2, 8), v_cache=_t(1, 0, 2, 8), cache_seqlens=0)
        out.append(_case(f"{op}: empty contiguous cache", fn, make, empty, ValueError, ["seqlen_cache", "0"]))
    if op == "quantize_kv[fp8]":  # 0 tokens: a correct empty result
        out.append(_case(f"{op}: 0 tokens", fn, make, lambda a: dict(x=_t(1, 0, 2, 16)), None, []))
    return out


def _value_cases():
    """Out-of-range index values (value contracts, docs/semantics.md §7) in the default, "off" and "async" modes."""
    import kvops
    import kvops.packed as kp

    base = _base_calls()
    out = []

    def add(op, name, mutate, exc, needles, mode=None):
        fn, make = base[op]
        out.append(_case(f"{op}: {name}" + (f" [{mode}]" if mode else ""), fn, make, mutate, exc, needles, mode))

    def setter(key, value):
        def mutate(a):
            a[key] = value() if callable(value) else value
            return a
        return mutate

    for mode, exc in ((None, RuntimeError), ("off", IndexError)):
        add("rotary_paged_cache_write", "negative position", setter("positions", torch.tensor([0, -1, 2])), exc,
            ["positions[1] = -1", "16"], mode)
        add("rotary_paged_cache_write", "position >= seqlen_ro", setter("positions", torch.tensor([0, 16, 2])), exc,
            ["positions[1] = 16", "16"], mode)
    add("apply_rotary", "negative position", setter("positions", torch.tensor([0, -1, 2])), RuntimeError,
        ["positions[1] = -1", "16"])
    add("paged_cache_write", "slot past the cache", setter("slot_mapping", torch.tensor([0, 16, 1])), RuntimeError,
        ["slot_mapping[1] = 16"])
    for mode in (None, "off"):
        add("paged_attention", "block id past the cache",
            setter("block_table", torch.tensor([[0, 1], [2, 9]], dtype=I32)), RuntimeError,
            ["block_table[1, 1] = 9"], mode)
        add("paged_attention", "seq_len past block_table", setter("seq_lens", torch.tensor([3, 9], dtype=I32)),
            RuntimeError, ["seq_lens[1] = 9"], mode)
    add("flash_attn_with_kvcache", "negative cache_seqlens", setter("cache_seqlens", torch.tensor([-1, 3], dtype=I32)),
        RuntimeError, ["cache_seqlens=-1"])
    add("flash_attn_with_kvcache", "cache_leftpad past cache_seqlens",
        setter("cache_leftpad", torch.tensor([0, 4], dtype=I32)), RuntimeError, ["cache_leftpad[1] = 4", "3"])
    add("paged_attention", "cache_leftpad past seq_lens", setter("cache_leftpad", torch.tensor([4, 0], dtype=I32)),
        RuntimeError, ["cache_leftpad[0] = 4", "seq_lens[0] = 3"])

    def bad_ids(a):
        a["cluster_ids"] = a["cluster_ids"].clone()
        a["cluster_ids"][0, 3, 1] = 200
        return a
    add("dequantize_kv[int2]", "cluster id past the centroids", bad_ids, RuntimeError,
        ["cluster_ids[0, 3, 1] = 200", "16"])
    # packed attention over an int2 segment with a bad cluster id
    def pk_int2():
        p = kp.quantize_kv(_t(1, 16, 2, 16), "int2")
        ids = p.cluster_ids.clone()
        ids[0, 5, 0] = 200
        return dict(q=_t(1, 2, 4, 16), k=p._replace(cluster_ids=ids), v=kp.quantize_kv(_t(1, 16, 2, 16, seed=1), "int2"))
    out.append(_case("packed_attention: int2 cluster id past the centroids",
                     lambda a: kp.packed_attention(a["q"], [a["k"]], [a["v"]]), pk_int2, lambda a: a, RuntimeError,
                     ["cluster_ids[0, 5, 0] = 200", "16"]))
    # streaming_update: bad cursors values
    add("streaming_update", "gap", setter("current_chunk_start", torch.tensor(6)), RuntimeError,
        ["current_chunk_start=6", "global_end=4"])
    # attention args that flash_attn_with_kvcache must reject before it appends k/v
    fa_kw = [("softcap=-1", dict(softcap=-1.0), ["softcap", "-1"]),
             ("window_size=(-5, -1)", dict(window_size=(-5, -1)), ["window", "-5"]),
             ("window_size=(3,)", dict(window_size=(3,)), ["window_size", "pair", "(3,)"]),
             ("window_size=(3, 0, 1)", dict(window_size=(3, 0, 1)), ["window_size", "pair", "(3, 0, 1)"]),
             # before: (2.5, 0) appended k/v, then failed in the attention op's schema without naming window_size
             ("window_size=(2.5, 0)", dict(window_size=(2.5, 0)), ["window_size", "pair", "(2.5, 0)"]),
             ("window_size float tensor", dict(window_size=lambda: torch.tensor([2.5, 0.0])), ["window_size", "float32"]),
             ("num_splits=1.5", dict(num_splits=1.5), ["num_splits", "1.5"]),
             ("softmax_scale='x'", dict(softmax_scale="x"), ["softmax_scale", "'x'"]),
             ("q head_dim 16", dict(q=lambda: _t(2, 1, 4, 16)), ["head_dim", "16"]),
             ("q float64", dict(q=lambda: _t(2, 1, 4, 8).double()), ["q", "float64"]),
             ("q float16", dict(q=lambda: _t(2, 1, 4, 8).half()), ["q", "float16"])]
    for what, kw, needles in fa_kw:
        def mutate(a, kw=kw):
            for k, v in kw.items():
                a[k] = v() if callable(v) else v
            return a
        add("flash_attn_with_kvcache", what, mutate, ValueError, needles)
    # streaming_update: the write's errors before the roll, devices and head slices
    su_kw = [("float64 value", dict(value=lambda: _t(1, 2, 2, 8).double()), ["value", "float64"]),
             ("short value", dict(value=lambda: _t(1, 1, 2, 8)), ["value", "(1, 1, 2, 8)"]),
             ("1-head key", dict(key=lambda: _t(1, 2, 1, 8), value=lambda: _t(1, 2, 1, 8)), ["key", "1 heads"]),
             ("meta cursors", dict(cursors=lambda: torch.tensor([4, 4], device="meta")), ["cursors", "meta"])]
    for what, kw, needles in su_kw:
        def mutate(a, kw=kw):
            for k, v in kw.items():
                a[k] = v()
            return a
        # an evicting append (the roll runs first), so a late check would have moved rows already
        def evicting(a, mutate=mutate):
            a["cursors"], a["current_chunk_start"] = torch.tensor([8, 8]), torch.tensor(8)
            return mutate(a)
        add("streaming_update", what, evicting, ValueError, needles)
    add("paged_attention", "HND cache read as NHD",
        lambda a: {**a, "k_cache": _t(6, 2, 4, 8), "v_cache": _t(6, 2, 4, 8), "q": _t(3, 6, 8),
                   "block_table": torch.tensor([[0, 1], [2, 3]], dtype=I32)},
        ValueError, ["HND", "kv_layout"])
    return out


def _overlap_cases():
    """Caches sharing memory other than the documented joint layouts (docs/semantics.md)."""
    base = _base_calls()
    out = []

    def self_overlap(shape):  # v_cache an as_strided view whose rows overlap
        buf = torch.zeros(int(torch.tensor(shape).prod()))
        return buf.as_strided(shape, (shape[1] * shape[3], shape[3], shape[3] // 2, 1))

    def interleaved(shape):  # K and V over one buffer, V shifted by half a head: they share bytes
        buf = torch.zeros(*shape[:-1], shape[-1] * 2)
        return buf[..., : shape[-1]], buf[..., shape[-1] // 2: shape[-1] // 2 + shape[-1]]

    for op, shape in (("cache_write", (1, 8, 2, 8)), ("paged_cache_write", (4, 4, 2, 8))):
        fn, make = base[op]
        out.append(_case(f"{op}: v_cache overlapping itself", fn, make,
                         lambda a, shape=shape: {**a, "v_cache": self_overlap(shape)}, ValueError,
                         ["v_cache", "overlaps itself"]))

        def inter(a, shape=shape):
            k, v = interleaved(shape)
            return {**a, "k_cache": k, "v_cache": v}
        out.append(_case(f"{op}: K and V interleaved over one buffer", fn, make, inter, ValueError,
                         ["k_cache and v_cache overlap"]))
        out.append(_case(f"{op}: k_cache is v_cache", fn, make, lambda a: {**a, "v_cache": a["k_cache"]},
                         ValueError, ["k_cache and v_cache overlap"]))
    fn, make = base["paged_kv_scatter"]
    def sc(a):
        k, v = interleaved((4, 4, 2, 8))
        return {**a, "k_caches": [k], "v_caches": [v]}
    out.append(_case("paged_kv_scatter: K and V interleaved over one buffer", fn, make, sc, ValueError,
                     ["caches[0] and caches[1] overlap"]))
    return out


# --- running and classifying (tests/unhappy.py: the registry's runner) --------------------------------------------
def unhappy_cases() -> list[Case]:
    """This source's cases for ``python -m tests.unhappy --report``."""
    return generate()


def classify(case: Case) -> tuple[str, str]:
    """(outcome, detail) of one case in this process."""
    from tests.unhappy import classify as run_one
    return run_one(case)


def run_cases(cases=None, timeout: float = 60.0, fork: bool = True) -> list[tuple[str, str, str]]:
    """``[(case name, outcome, detail)]``; ``fork``: each case in a forked child (crash/hang isolation)."""
    from tests.unhappy import run_cases as run
    return run(generate() if cases is None else cases, timeout=timeout, fork=fork)


if __name__ == "__main__":  # python tests/unhappy_ops_cases.py [REPO] [-v]: this source's counts (tests/unhappy.py)
    from tests.unhappy import report

    repo = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    report(["--report", "--source", "ops", *(["--repo", repo] if repo else []),
            *[a for a in sys.argv[1:] if a.startswith("-")]])

"""The cases of the ahead-of-time check (``tools/aot.py``): shapes a serving engine launches, on ``meta``
tensors, passed to the launchers' own ``plan_*`` functions, which choose the grid, tiles and options.

Axes (docs/gpu.md): dtypes fp16/bf16/fp32 and fp8 e4m3 caches; head_dim 64, 80, 96, 128, 256; block_size 1, 16, 32,
64, 128; GQA groups 1, 4, 7, 8; NHD and HND cache strides; every feature flag (causal, window, softcap, sinks; LSE
is always produced), decode (split-KV + merge, short and 128K contexts) and prefill; rotary styles; every packed
format. The full product of the attention axes is large, so it is covered as: every (dtype, head_dim, group,
block_size, layout) with all flags off and all flags on, plus every single flag alone at the heaviest tiles.
:func:`flag_coverage` checks that every boolean constexpr of every kernel is compiled both ways, so a flag added to
a kernel without a case here fails the check.
"""

from __future__ import annotations

import itertools

import torch

from .aot import meta

FLOATS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_SIZES = (1, 16, 32, 64, 128)
GROUPS = (1, 4, 7, 8)
H_KV = 8


def _cache(pages: int, block_size: int, heads: int, d: int, dtype, layout: str) -> torch.Tensor:
    if layout == "HND":  # [P, H_kv, block_size, D] storage seen as [P, block_size, H_kv, D]
        return meta((pages, heads, block_size, d), dtype).transpose(1, 2)
    return meta((pages, block_size, heads, d), dtype)


def _attention(dtype: str, d: int, group: int, block_size: int, layout: str, flags: dict, mode: str,
               batch: int = 32, ctx: int = 4096, h_kv: int = H_KV):
    from kvops._checks.features import AttnFeatures
    from kvops.triton.paged_attention import plan_paged_attention

    fp8 = dtype == "fp8"
    q_dtype = torch.bfloat16 if fp8 else FLOATS[dtype]
    kv_dtype = torch.float8_e4m3fn if fp8 else q_dtype
    q_len = 1 if mode == "decode" else 512
    if mode == "prefill":
        batch = 4
    blocks = -(-ctx // block_size)
    pages = batch * blocks

    def make(cap):
        q = meta((batch * q_len, h_kv * group, d), q_dtype)
        k = _cache(pages, block_size, h_kv, d, kv_dtype, layout)
        v = _cache(pages, block_size, h_kv, d, kv_dtype, layout)
        cu = meta((batch + 1,), torch.int32)
        seq = meta((batch,), torch.int32)
        table = meta((batch, blocks), torch.int32)
        sc = meta((1,), torch.float32) if fp8 else None
        sinks = meta((h_kv * group,), torch.float32) if flags.get("sinks") else None
        features = AttnFeatures(  # docs/attention_features.md
            alibi_slopes=meta((h_kv * group,), torch.float32) if flags.get("alibi") else None,
            window_right=64 if flags.get("right") else -1,
            cache_leftpad=meta((batch,), torch.int32) if flags.get("leftpad") else None,
            sink_tokens=4 if flags.get("sink_tokens") else 0,
            rope_theta=10000.0 if flags.get("rope") else None,
            # docs/tree-mask.md: each sequence's q_len x q_len mask, as bools or as bits padded to whole bytes
            custom_mask=meta((batch * q_len * q_len,), torch.bool) if flags.get("mask") else None,
            packed_custom_mask=meta((batch * -(-q_len * q_len // 8),), torch.uint8) if flags.get("packed") else None)
        launches, _, _ = plan_paged_attention(
            q, k, v, cu, seq, table, q_len, d**-0.5, bool(flags.get("causal", mode == "decode")),
            128 if flags.get("window") else -1, 30.0 if flags.get("softcap") else 0.0, sinks, sc, sc, cap,
            features)
        return launches

    on = ",".join(k for k, v in flags.items() if v) or "-"
    return (f"{mode} {dtype} D={d} G={group} bs={block_size} {layout} B={batch} ctx={ctx} Hkv={h_kv} flags={on}",
            make)


FEATURES = dict(alibi=True, leftpad=True, sink_tokens=True, rope=True)  # docs/attention_features.md
MASKS = ("mask", "packed")  # custom masks (docs/tree-mask.md): the prefill kernel, in either form


def on(targets: str, case):
    """A subset case compiled only for ``targets`` (comma-separated; the rest of the subset's targets skip it)."""
    label, make = case
    make.targets = tuple(targets.split(","))
    return label, make


def attention_cases(subset: bool):
    all_on = dict(causal=True, window=True, softcap=True, sinks=True)
    off = dict(causal=False, window=False, softcap=False, sinks=False)
    if subset:  # light shapes on every target; the heaviest tiles, fp8 and the features each on one target
        yield _attention("fp8", 80, 7, 1, "HND", off, "prefill")
        yield _attention("bf16", 64, 1, 16, "NHD", off, "decode")
        yield on("sm_86", _attention("fp32", 256, 8, 16, "NHD", all_on, "prefill"))
        yield on("sm_90", _attention("fp32", 256, 8, 16, "HND", all_on, "decode", batch=1, ctx=131072))
        # one KV head at 128K: 256 splits, which the merge reads in chunks of 16 (it spilled 6 KB loading all)
        yield on("sm_80", _attention("bf16", 256, 8, 16, "NHD", all_on, "decode", batch=1, ctx=131072, h_kv=1))
        # tiles that spilled before (docs/gpu.md): 16-bit prefill at padded width 128 with every flag (sm_80), fp32
        # decode at 128 with GQA 4:1 (sm_86)
        yield on("sm_80", _attention("fp16", 80, 1, 16, "NHD", all_on, "prefill"))
        yield on("sm_86", _attention("fp32", 80, 4, 16, "NHD", off, "decode"))
        yield on("sm_80", _attention("fp8", 128, 7, 1, "NHD", all_on, "decode"))
        # ptxas for sm_90 held these at 80-255 registers and spilled 4-28 B (bf16 prefill at 256 with 32-token
        # tiles, fp8 decode at 64 and fp32 decode at 64 over 4 warps)
        yield on("sm_90", _attention("bf16", 256, 1, 16, "NHD", off, "prefill"))
        yield on("sm_90", _attention("fp8", 64, 1, 16, "NHD", off, "decode"))
        yield on("sm_90", _attention("fp32", 64, 4, 1, "NHD", off, "decode"))
        yield on("sm_86", _attention("fp32", 256, 8, 16, "NHD", {**off, "alibi": True}, "decode"))  # 16 B, 4 warps
        # every attention feature (docs/attention_features.md) of each kernel: prefill with a right window (not
        # causal), decode with the features on top of every flag
        yield on("sm_80", _attention("bf16", 128, 8, 16, "NHD", {**off, "window": True, "softcap": True,
                                                                  "sinks": True, **FEATURES, "right": True},
                                     "prefill"))
        yield on("sm_86", _attention("fp16", 128, 8, 16, "NHD", {**all_on, **FEATURES}, "decode"))
        # custom masks (docs/tree-mask.md) with every flag and feature a mask combines with, at the heaviest tiles
        yield on("sm_86", _attention("fp32", 256, 8, 16, "NHD", {**all_on, **FEATURES, "mask": True}, "prefill"))
        yield on("sm_80", _attention("bf16", 128, 8, 16, "NHD", {**all_on, **FEATURES, "packed": True}, "prefill"))
        yield on("sm_90", _attention("bf16", 256, 1, 16, "NHD", {**all_on, **FEATURES, "packed": True}, "prefill"))
        yield on("sm_90", _attention("fp8", 128, 7, 1, "HND", {**all_on, "mask": True}, "prefill"))
        return
    for mode, dtype, d, group, bs, layout in itertools.product(
            ("decode", "prefill"), (*FLOATS, "fp8"), HEAD_DIMS, GROUPS, BLOCK_SIZES, ("NHD", "HND")):
        for flags in (off, all_on):
            yield _attention(dtype, d, group, bs, layout, flags, mode)
    for mode, dtype, name in itertools.product(("decode", "prefill"), (*FLOATS, "fp8"),
                                               (*all_on, *FEATURES, "right", *MASKS)):
        yield _attention(dtype, 256, 8, 16, "NHD", {**off, name: True}, mode)
    for mode, dtype, d in itertools.product(("decode", "prefill"), (*FLOATS, "fp8"), HEAD_DIMS):
        yield _attention(dtype, d, 8, 16, "NHD", {**all_on, **FEATURES}, mode)
    for dtype, d, mask in itertools.product((*FLOATS, "fp8"), HEAD_DIMS, MASKS):
        yield _attention(dtype, d, 8, 16, "NHD", {**all_on, **FEATURES, mask: True}, "prefill")
    for dtype, d, (batch, ctx, h_kv) in itertools.product(
            (*FLOATS, "fp8"), HEAD_DIMS, ((1, 131072, 1), (1, 131072, 8), (4, 32768, 8), (256, 2048, 8))):
        yield _attention(dtype, d, 8, 16, "NHD", all_on, "decode", batch=batch, ctx=ctx, h_kv=h_kv)


def _write(dtype: str, d: int, heads: int, block_size: int, layout: str, rotary: str | None, n: int = 8192):
    from kvops.triton.paged_write import plan_scatter_tokens
    from kvops.triton.rotary import plan_rotary_write

    fp8 = dtype == "fp8"
    src_dtype = torch.bfloat16 if fp8 else FLOATS[dtype]
    cache_dtype = torch.float8_e4m3fn if fp8 else src_dtype

    def make(cap):
        key = meta((n, heads, d), src_dtype)
        cache = _cache(n // block_size + 8, block_size, heads, d, cache_dtype, layout)
        slots = meta((n,), torch.int64)
        scale = meta((heads,), torch.float32) if fp8 else None
        if rotary is None:
            return plan_scatter_tokens(key, cache, slots, 0, scale, cap)
        half = d // 2 if rotary != "partial" else d // 4
        cos, sin = meta((32768, half), torch.float32), meta((32768, half), torch.float32)
        return [*plan_rotary_write(key, cache, slots, meta((n,), torch.int64), cos, sin, rotary == "gptj", 0, scale,
                                   cap),
                *plan_scatter_tokens(key, cache, slots, 0, scale, cap)]  # the value, as rotary_paged_cache_write

    return f"{dtype} D={d} H={heads} bs={block_size} {layout} rotary={rotary or '-'}", make


def write_cases(subset: bool):
    if subset:
        yield _write("fp8", 256, 8, 16, "NHD", "neox")
        yield _write("bf16", 80, 7, 1, "HND", "gptj")
        return
    for dtype, d, bs, layout, rot in itertools.product(
            (*FLOATS, "fp8"), HEAD_DIMS, BLOCK_SIZES, ("NHD", "HND"), (None, "neox", "gptj", "partial")):
        yield _write(dtype, d, 8, bs, layout, rot)
    for dtype, heads in itertools.product((*FLOATS, "fp8"), (1, 7, 32, 128)):
        yield _write(dtype, 128, heads, 16, "NHD", None)


def _copy(dtype: str, d: int, heads: int):
    from kvops.triton.contiguous import plan_copy_rows

    def make(cap):
        src = meta((4, 2048, heads, d), FLOATS[dtype])
        dst = meta((4, 8192, heads, d), FLOATS[dtype])
        return plan_copy_rows(src, dst, 1024, 0, cap)

    return f"{dtype} D={d} H={heads}", make


def _transfer(dtype, d: int, heads: int, to_staging: bool):
    from kvops.triton.transfer import plan_staging

    def make(cap):
        layers = 32
        staging = meta((2, layers, 4096, heads, d), dtype)
        return plan_staging(meta((2 * layers,), torch.int64), meta((2 * layers, 4), torch.int64), 16,
                            meta((256,), torch.int32), 0, 0, staging, to_staging, cap)

    return f"{str(dtype).removeprefix('torch.')} D={d} H={heads} {'gather' if to_staging else 'scatter'}", make


def data_movement_cases(subset: bool):
    dts = ("bf16",) if subset else tuple(FLOATS)
    for dtype, d, heads in itertools.product(dts, (80, 256) if subset else HEAD_DIMS, (8,) if subset else (1, 8, 32)):
        yield _copy(dtype, d, heads)
    item_dtypes = (torch.bfloat16,) if subset else (torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.int64)
    for dtype, d, to in itertools.product(item_dtypes, (128,) if subset else HEAD_DIMS, (True, False)):
        yield _transfer(dtype, d, 8, to)


def _packed_attention(fmt: str | None, dtype: str, d: int, group: int, t: int, n: int, counts: bool,
                      group_size: int = 64, stages: int = 1):
    from kvops._checks.packed import packed_layout
    from kvops.triton.packed_attention import plan_packed_attention

    def make(cap):
        b, h_kv = 2, 8
        dense = dict(codes=meta((b, n, h_kv, d), FLOATS[dtype]), scales=None, zeros=None, centroids=None,
                     cluster_ids=None)
        segments = [(dense, dense, None)]
        if fmt is not None:
            lay = packed_layout(fmt, b, n, h_kv, d, group_size=group_size, stages=stages)
            seg = {k: meta(s.shape, s.dtype) if s is not None else None for k, s in lay.items()}
            segments.append((seg, seg, fmt))
        q = meta((b, t, h_kv * group, d), FLOATS[dtype])
        rows = t * group
        m, l, acc = meta((b * h_kv, rows)), meta((b * h_kv, rows)), meta((b * h_kv, rows, d))
        cnt = meta((len(segments) * n,), torch.int32) if counts else None
        return plan_packed_attention(q, segments, h_kv, m, l, acc, cnt, d**-0.5, cap)

    return (f"{fmt or 'dense'} {dtype} D={d} G={group} T={t} N={n} group_size={group_size} stages={stages} "
            f"counts={counts}", make)


def _quant(fmt: str, dtype: str, d: int, group_size: int = 64, stages: int = 1, direction: str = "quantize"):
    from kvops._checks.packed import packed_layout
    from kvops.triton.packed_quant import plan_dequantize, plan_quantize

    def make(cap):
        b, t, h = 2, 4096, 8
        lay = packed_layout(fmt, b, t, h, d, group_size=group_size, stages=stages)
        p = {k: meta(s.shape, s.dtype) if s is not None else None for k, s in lay.items()}
        x = meta((b, t, h, d), FLOATS[dtype])
        if direction == "quantize":
            return plan_quantize(x, p["codes"], p["scales"], p["zeros"], fmt, cap)
        return plan_dequantize(p["codes"], p["scales"], p["zeros"], p["centroids"], p["cluster_ids"], fmt, x, cap)

    return f"{fmt} {direction} {dtype} D={d} group_size={group_size} stages={stages}", make


def packed_cases(subset: bool):
    if subset:
        yield on("sm_90", _packed_attention("int4", "fp32", 128, 8, 512, 4096, True, group_size=32))
        yield on("sm_80", _packed_attention("int4", "fp32", 128, 1, 1, 4096, True))  # spilled 12 B over 4 warps
        # the second full matrix: ptxas for sm_86 held fp8 D=64 at 128 registers over two stages (8 B spills), for
        # sm_90 int4 D=64 with 16 rows at 72 over 4 warps (44 B)
        yield on("sm_86", _packed_attention("fp8", "fp16", 64, 1, 512, 4096, False))
        yield on("sm_90", _packed_attention("int4", "bf16", 64, 8, 1, 4096, True))
        yield _packed_attention("fp8", "bf16", 128, 7, 1, 4096, False)
        yield _quant("int4", "bf16", 128, group_size=32)
        yield _quant("int2", "fp16", 256, group_size=32, stages=2, direction="dequantize")
        yield _quant("int4", "fp32", 256, group_size=128, direction="dequantize")
        yield _quant("int8", "bf16", 80)
        yield _quant("int8", "fp16", 256, direction="dequantize")
        return
    for fmt, dtype, d, group, t, counts in itertools.product(
            (None, "int8", "fp8", "int4", "int2"), FLOATS, (64, 128, 256), (1, 8), (1, 512), (False, True)):
        yield _packed_attention(fmt, dtype, d, group, t, 4096, counts)
    for fmt, gs, stages in (("int4", 32, 1), ("int4", 128, 1), ("int2", 32, 1), ("int2", 64, 2), ("int2", 32, 3)):
        yield _packed_attention(fmt, "fp32", 256, 8, 512, 4096, True, group_size=gs, stages=stages)
    for fmt, dtype, d, gs, direction in itertools.product(
            ("int8", "int4", "int2"), FLOATS, (64, 128, 256), (32, 64, 128), ("quantize", "dequantize")):
        if (fmt == "int8" and gs != 64) or gs > d:
            continue
        yield _quant(fmt, dtype, d, group_size=gs, stages=2 if fmt == "int2" else 1, direction=direction)


def _mla_attention(dtype: str, block_size: int, mode: str, causal: bool = True, batch: int = 32, ctx: int = 4096,
                   heads: int = 128, rank: int = 512, rope: int = 64, num_splits: int | None = None):
    """DeepSeek's absorbed MLA (kvops/triton/mla.py): q [T, 128, 576] over one latent head of 512 + 64 columns."""
    from kvops.triton.mla import plan_mla_attention

    fp8 = dtype == "fp8"
    q_dtype = torch.bfloat16 if fp8 else FLOATS[dtype]
    q_len = 1 if mode == "decode" else 512
    if mode == "prefill":
        batch = 4
    blocks = -(-ctx // block_size)

    def make(cap):
        q = meta((batch * q_len, heads, rank + rope), q_dtype)
        cache = meta((batch * blocks, block_size, rank + rope), torch.float8_e4m3fn if fp8 else q_dtype)
        launches, _, _ = plan_mla_attention(
            q, cache, meta((batch + 1,), torch.int32), meta((batch,), torch.int32), meta((batch, blocks), torch.int32),
            q_len, rank, (rank + rope) ** -0.5, causal, meta((), torch.float32) if fp8 else None, cap,
            num_splits=num_splits)
        return launches

    return (f"mla {mode} {dtype} H={heads} rank={rank} rope={rope} bs={block_size} B={batch} ctx={ctx} "
            f"causal={causal} splits={num_splits or 'auto'}", make)


def _mla_write(dtype: str, block_size: int, rotary: str | None, rank: int = 512, rope: int = 64, n: int = 8192):
    from kvops.triton.mla import plan_mla_write

    fp8 = dtype == "fp8"
    src_dtype = torch.bfloat16 if fp8 else FLOATS[dtype]

    def make(cap):
        cache = meta((n // block_size + 8, block_size, rank + rope), torch.float8_e4m3fn if fp8 else src_dtype)
        tables = (meta((163840, rope // 2), src_dtype),) * 2 if rotary else (None, None)
        return plan_mla_write(meta((n, rank), src_dtype), meta((n, rope), src_dtype), cache, meta((n,), torch.int64),
                              meta((), torch.float32) if fp8 else None, meta((n,), torch.int64) if rotary else None,
                              *tables, rotary == "gptj", cap)

    return f"mla write {dtype} rank={rank} rope={rope} bs={block_size} rotary={rotary or '-'}", make


def mla_cases(subset: bool):
    """DeepSeek-V2/V3 geometry (128 heads, kv_lora_rank 512, rope 64), block_size 16 and 64 (FlashMLA's)."""
    if subset:  # decode with and without splits, prefill, bf16/fp8 (sm_80 decodes e4m3 bits), fp32 and fp16 once
        yield _mla_attention("bf16", 64, "decode")
        yield _mla_attention("fp8", 16, "prefill")
        yield on("sm_90", _mla_attention("fp32", 64, "prefill", causal=False))
        yield on("sm_80", _mla_attention("fp8", 64, "decode", batch=1, ctx=131072))
        yield _mla_write("fp8", 64, "neox")
        yield on("sm_86", _mla_write("bf16", 16, "gptj"))
        yield on("sm_90", _mla_write("fp16", 16, None))
        return
    for mode, dtype, bs, causal in itertools.product(("decode", "prefill"), (*FLOATS, "fp8"), (1, 16, 64),
                                                      (True, False)):
        yield _mla_attention(dtype, bs, mode, causal)
    for dtype, bs in itertools.product((*FLOATS, "fp8"), (16, 64)):
        yield _mla_attention(dtype, bs, "decode", batch=128, num_splits=1)  # no split: the direct store
        yield _mla_attention(dtype, bs, "decode", batch=1, ctx=131072)
        yield _mla_attention(dtype, bs, "decode", heads=16)  # a tensor-parallel slice of 128 heads (8 GPUs)
    for dtype, bs, rot in itertools.product((*FLOATS, "fp8"), (1, 16, 64), (None, "neox", "gptj")):
        yield _mla_write(dtype, bs, rot)


def _merge(dtype: str, d: int, heads: int, n: int | None, t: int = 4096):
    """``kvops.merge_attention_states`` (``n`` None: two parts) or ``merge_attention_states_many`` with ``n`` parts:
    ``t`` query rows (a prefill chunk or a large decode batch), kvops' LSE layout [H, T]."""
    from kvops.triton.merge import plan_merge_many, plan_merge_two

    def make(cap):
        dt = FLOATS[dtype]
        out, lse = meta((t, heads, d), dt), meta((heads, t), torch.float32)
        if n is None:
            return plan_merge_two(meta((t, heads, d), dt), lse, meta((t, heads, d), dt), lse, out, lse, cap)
        return plan_merge_many(meta((n, t, heads, d), dt), meta((n, heads, t), torch.float32), out, lse, cap)

    return f"{dtype} D={d} H={heads} parts={n or 2} T={t}", make


def merge_cases(subset: bool):
    if subset:
        yield _merge("bf16", 128, 32, None)
        yield _merge("fp16", 80, 7, None)
        yield _merge("fp32", 256, 8, 4)
        yield _merge("bf16", 64, 14, 8)
        return
    for dtype, d, heads, n in itertools.product(FLOATS, HEAD_DIMS, (1, 7, 32, 128), (None, 3, 8)):
        yield _merge(dtype, d, heads, n)


def cases(subset: bool = False):
    """``(label, make)`` pairs; ``make(capability)`` returns the launches the launchers plan for that device."""
    for family in (attention_cases, write_cases, data_movement_cases, packed_cases, merge_cases, mla_cases):
        for label, make in family(subset):
            yield label, make


def flag_coverage(subset: bool = False, capability: tuple[int, int] = (9, 0)) -> list[str]:
    """Boolean constexprs of a kernel that the cases compile only one way (``[]`` when every flag is covered); a flag
    a launch leaves at the kernel's default counts as compiled with that default."""
    from .aot import kernel_name

    seen: dict[tuple[str, str], set] = {}
    for _, make in cases(subset):
        for launch in make(capability):
            defaults = {p.name: p.default for p in launch.kernel.params
                        if p.is_constexpr and isinstance(p.default, bool)}
            for name, value in {**defaults, **launch.constexprs}.items():
                if isinstance(value, bool):
                    seen.setdefault((kernel_name(launch.kernel), name), set()).add(value)
    return sorted(f"{k}.{f} only {sorted(v)}" for (k, f), v in seen.items() if len(v) < 2)

"""The workloads and candidates of ``benchmarks/paged_decode.py`` (a helper module, not a benchmark): the paged,
dense and FlexAttention-paged copies of the same K/V (``make_case``), the candidates (the ideal, kvops eager and
compiled, gather-then-SDPA, FlexAttention) and ``measure``, which times them interleaved (``benchmarks/_harness.py``)
and gives each one's ratio to the ideal. The candidates are described in paged_decode.py's docstring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kvops

import _harness as harness

BLOCK_SIZE = 16
FLEX_PAGE = 128
# K + V of the blocks an in-cache case's tables cycle over (in_cache_case): within a core's L2 on current x86 CPUs
IN_CACHE_BYTES = 256 << 10
sync = lambda: None  # noqa: E731  (paged_decode.py sets torch.cuda.synchronize on CUDA)


def interleaved(cands: dict, rounds: int, clock: str) -> harness.Timings:
    """Every candidate's per-call seconds per round (benchmarks/_harness.py: warm-up, ~2 ms samples, rotated order)."""
    return harness.interleave(cands, rounds, clock=clock, sync=sync, max_reps=200)


def make_case(geometry: tuple, batch: int, q_len: int, context: int, dtype, device, flex: bool, seed: int = 0):
    """Paged, dense (and FlexAttention-paged) copies of the same K/V; ``geometry``: ``(H_q, H_kv, D)``; ``context``
    includes the ``q_len`` new tokens."""
    h_q, h_kv, d = geometry
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 8
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, h_kv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, h_kv, d, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: batch * blocks_per_seq].view(batch, -1).to(torch.int32)
    q = torch.randn(batch * q_len, h_q, d, generator=g).to(dtype)
    dense = lambda c: c[table.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()  # noqa: E731
    group = h_q // h_kv
    # folded queries [B, H_kv, q_len * G, D], rows (query, group head)
    q_f = q.view(batch, q_len, h_kv, group, d).permute(0, 2, 1, 3, 4).reshape(batch, h_kv, q_len * group, d)
    mask = None
    if q_len > 1:  # bottom-right causal: query i sits at position context - q_len + i
        pos = context - q_len + torch.arange(q_len).repeat_interleave(group)
        mask = torch.arange(context)[None, :] <= pos[:, None]
    c = dict(q=q, q_f=q_f.contiguous(), mask=mask, k_cache=k_cache, v_cache=v_cache, block_table=table,
             seq_lens=torch.full((batch,), context, dtype=torch.int32),
             cu_seqlens_q=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32), max_seqlen_q=q_len)
    c["k_dense"], c["v_dense"] = dense(k_cache), dense(v_cache)
    c = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in c.items()}
    c.update(batch=batch, q_len=q_len, context=context, group=group)
    if flex:
        c.update(make_flex(c, h_q, device))
    return c


def make_flex(c, h_q, device):
    """FlexAttention's paged cache ``[1, H_kv, n_pages * 128, D]`` holding the same K/V, and its block mask."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask

    batch, context = c["batch"], c["context"]
    n_pages = batch * -(-context // FLEX_PAGE)
    paged = PagedAttention(n_pages, FLEX_PAGE, batch, device=device)
    for b in range(batch):
        paged.reserve(torch.tensor(b, device=device), torch.tensor(context, device=device))
    k_dense, v_dense = c["k_dense"], c["v_dense"]
    k_flex = k_dense.new_zeros(1, k_dense.shape[1], n_pages * FLEX_PAGE, k_dense.shape[3])
    v_flex = torch.zeros_like(k_flex)
    positions = torch.arange(context, device=device)[None].expand(batch, context)
    paged.assign(torch.arange(batch, device=device), positions, k_dense, v_dense, k_flex, v_flex)
    lens = c["seq_lens"].long()
    logical = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < lens[b], batch, None, 1, context,
                                device=device, BLOCK_SIZE=(FLEX_PAGE, FLEX_PAGE))
    q_flex = c["q"].view(batch, 1, h_q, -1).transpose(1, 2)  # [B, H_q, 1, D]
    return dict(k_flex=k_flex, v_flex=v_flex, q_flex=q_flex, flex_mask=paged.convert_logical_block_mask(logical))


def run_ideal(c):
    return F.scaled_dot_product_attention(c["q_f"], c["k_dense"], c["v_dense"], attn_mask=c["mask"])


def run_gather(c):
    t = c["block_table"].long()
    k = c["k_cache"][t].flatten(1, 2)[:, : c["context"]].transpose(1, 2)
    v = c["v_cache"][t].flatten(1, 2)[:, : c["context"]].transpose(1, 2)
    return F.scaled_dot_product_attention(c["q_f"], k, v, attn_mask=c["mask"])


def run_kvops(c):
    return kvops.paged_attention(c["q"], c["k_cache"], c["v_cache"], c["cu_seqlens_q"], c["seq_lens"],
                                 c["block_table"], c["max_seqlen_q"])


# one graph per (geometry, dtype, batch == 1) under dynamic shapes (sizes 0/1 specialize): above Dynamo's default 8
torch._dynamo.config.recompile_limit = 64
run_compiled = torch.compile(run_kvops, fullgraph=True, dynamic=True)
run_ideal_compiled = torch.compile(run_ideal, fullgraph=True, dynamic=True)
_flex_compiled = None


def run_flex(c):
    global _flex_compiled
    if _flex_compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _flex_compiled = torch.compile(flex_attention, fullgraph=True)
    return _flex_compiled(c["q_flex"], c["k_flex"], c["v_flex"], block_mask=c["flex_mask"], enable_gqa=True)


def run_checked(c):
    """Eager kvops in the default value-check mode ("eager": the index tensors' contents are checked per call)."""
    with kvops.value_checks("eager"):
        return run_kvops(c)


def graph_entry_us(device, clock: str, rounds: int = 5) -> float:
    """Per-call cost of entering a compiled graph (guards, wrappers): a compiled one-multiply over a decode's
    inputs minus the eager multiply, in microseconds. Every compiled B = 1 call pays it once."""
    c = make_case((14, 2, 64), 1, 1, 256, torch.float32, device, flex=False)  # Qwen2.5-0.5B
    mul = lambda c: c["q"] * 2  # noqa: E731
    cmul = torch.compile(mul, fullgraph=True, dynamic=True)
    t = interleaved({"eager": lambda: mul(c), "compiled": lambda: cmul(c)}, rounds, clock)
    return (t.time("compiled").median - t.time("eager").median) * 1e6


def unfold(c, out_f):
    """Ideal's ``[B, H_kv, q_len * G, D]`` back to kvops' packed ``[T, H_q, D]``."""
    b, h_kv, _, d = out_f.shape
    return out_f.view(b, h_kv, c["q_len"], c["group"], d).permute(0, 2, 1, 3, 4).reshape(-1, h_kv * c["group"], d)


def in_cache_case(c):
    """``c`` with every sequence's block table cycling over the first few blocks of the case's tables (their K + V at
    most ``IN_CACHE_BYTES``, or one block where a block is larger; ``make_case``'s tables hold no padding): the same
    calls and math, each block read many times, so the reads hit the core's caches. Its time is the kernel's without
    the memory's cost (outputs differ from ``c``'s: other K/V). ``in_cache_blocks``, ``in_cache_kib``: how many blocks,
    their K + V in KiB."""
    t = c["block_table"]
    block_bytes = 2 * c["k_cache"][0].numel() * c["k_cache"].element_size()
    few = t.flatten()[: max(1, IN_CACHE_BYTES // block_bytes)]
    return dict(c, block_table=few.repeat(-(-t.numel() // few.numel()))[: t.numel()].view_as(t).contiguous(),
                in_cache_blocks=few.numel(), in_cache_kib=few.numel() * block_bytes >> 10)


def measure(c, cands_wanted, rounds, clock, extras=False, copy=None):
    """Ratios (Spreads) of every candidate to the ideal, and the largest difference of any candidate's output from
    the ideal's. With ``extras`` (B = 1: per-call overheads matter) also compiled kvops vs the compiled ideal (both
    pay the graph entry) and eager kvops with the default value checks. With ``copy``, a pair ``(fn, bytes)``: a tensor
    copy and the bytes it reads and writes per call (rows under a bandwidth target), the same rounds also time the copy
    and eager kvops over :func:`in_cache_case` ("eager in cache": ``ms``, ``gbs`` and ``bw`` count the case's K/V
    bytes; its blocks in ``in_cache_blocks`` and ``in_cache_kib``), and give the copy's GB/s (``copy_gbs``) and every
    kvops candidate's K/V GB/s over the copy's per round (``fraction``)."""
    fns = {"eager": run_kvops, "compiled": run_compiled, "gather": lambda c: unfold(c, run_gather(c)),
           "flex": lambda c: run_flex(c).transpose(1, 2).flatten(0, 1)}  # [B, H_q, 1, D] -> [B, H_q, D]
    ref = unfold(c, run_ideal(c)).float()
    err = max((fns[n](c).float() - ref).abs().max().item() for n in cands_wanted)
    cands = {"ideal": lambda: run_ideal(c)}
    for n in cands_wanted:
        cands[n] = {"eager": lambda: run_kvops(c), "compiled": lambda: run_compiled(c),
                    "gather": lambda: run_gather(c), "flex": lambda: run_flex(c)}[n]
    if extras:
        cands["ideal_compiled"] = lambda: run_ideal_compiled(c)
        cands["checked"] = lambda: run_checked(c)
    if copy is not None:
        cands["copy"] = copy[0]
        if "eager" in cands:
            cached = in_cache_case(c)
            cands["eager in cache"] = lambda: run_kvops(cached)
    t = interleaved(cands, rounds, clock)
    timed = [n for n in cands if n != "copy"]
    res = {"err": err, "ms": {n: t.time(n, 1e3).median for n in timed}}
    res.update({n: t.ratio(n, "ideal") for n in timed if n != "ideal"})
    if extras and "compiled" in cands:
        res["compiled_vs_compiled"] = t.ratio("compiled", "ideal_compiled")
    # kvops over each peer measured in the same rounds, for targets against a peer (TARGETS' baseline)
    res["vs"] = {(m, b): t.ratio(m, b) for m in ("eager", "compiled") if m in cands
                 for b in ("gather", "flex") if b in cands}
    kv_bytes = c["k_dense"].numel() * 2 * c["k_dense"].element_size()
    res["gbs"] = {n: kv_bytes / (ms * 1e-3) / 1e9 for n, ms in res["ms"].items()}
    res["bw"] = {n: harness.Spread.of(kv_bytes / s / 1e9 for s in t.times[n]) for n in timed}  # GB/s per round
    if copy is not None:
        res["copy_gbs"] = harness.Spread.of(copy[1] / s / 1e9 for s in t.times["copy"])
        res["fraction"] = {n: t.ratio("copy", n).scaled(kv_bytes / copy[1]) for n in timed}
    if "eager in cache" in cands:
        res.update(in_cache_blocks=cached["in_cache_blocks"], in_cache_kib=cached["in_cache_kib"])
    return res

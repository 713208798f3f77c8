"""kvops.paged_attention on CPU: against a plain fp64 reference, contracts in every mode, opcheck, compile count.

The numerical matrix samples (does not take the product of) block_size {1, 16, 128}, (H_q, H_kv) {(4,4), (8,2), (5,1),
(14,2), (28,4)}, (D, D_v) incl. 80, 256 and D_v != D, q dtype, cache layout (separate, joint K|V allocation, K/V
interleaved per block, padded heads/dims) and features (window, softcap, sinks, non-causal, fp8 per tensor/per head).
Every case mixes sequence lengths 0, 1, block_size, block_size + 1 (and > 1000 in half the cases) with q_len 1, 3, 17,
uses permuted block tables (some with shared prefix blocks) and fills every unused slot and unreferenced block with NaN.
"""

from __future__ import annotations

import random
import unittest
from contextlib import contextmanager

import expecttest
import torch
import torch._dynamo.testing

import kvops
import kvops.cpu.paged_attention as cpu_kernel
from kvops.reference.attention import reference  # the oracle (fp64)
from tests.contract import raises_everywhere

FP8 = torch.float8_e4m3fn
TOL = {  # (atol, rtol) of out per q dtype, against the fp64 reference on the same (rounded) inputs
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (2e-3, 2e-3),
}
LSE_TOL = 2e-4


# --- building paged caches -----------------------------------------------------------------------------------------
def alloc_caches(num_blocks, block_size, h_kv, d, d_v, dtype, layout, fill):
    """NaN-filled K/V caches. layout: separate | joint (one [P, bs, H_kv, D + D_v] allocation split on the last dim) |
    outer (one [P, 2, bs, H_kv, D] allocation: block and row dims cannot be merged) | padded (heads/dims sliced out of a
    wider allocation)."""
    if layout == "separate":
        return (torch.full((num_blocks, block_size, h_kv, d), fill, dtype=dtype),
                torch.full((num_blocks, block_size, h_kv, d_v), fill, dtype=dtype))
    if layout == "joint":
        kv = torch.full((num_blocks, block_size, h_kv, d + d_v), fill, dtype=dtype)
        return kv[..., :d], kv[..., d:]
    if layout == "outer" and d == d_v:
        kv = torch.full((num_blocks, 2, block_size, h_kv, d), fill, dtype=dtype)
        return kv[:, 0], kv[:, 1]
    k = torch.full((num_blocks, block_size, h_kv + 2, d + 8), fill, dtype=dtype)
    v = torch.full((num_blocks, block_size, h_kv + 2, d_v + 8), fill, dtype=dtype)
    return k[:, :, 1 : 1 + h_kv, :d], v[:, :, 1 : 1 + h_kv, 4 : 4 + d_v]


def make_inputs(seed, seq_lens, q_lens, block_size=16, h_q=4, h_kv=2, d=16, d_v=None, dtype=torch.float32,
                cache_dtype=None, layout="separate", shared_prefix_blocks=0, scale_per_head=False, sinks=False,
                garbage=float("nan"), logical=None):
    """Paged inputs for sequences of ``seq_lens`` KV tokens with ``q_lens`` new queries each.

    Block tables are random permutations (plus shared prefix blocks when asked); unused table entries are -1; every
    slot not covered by a ``seq_len`` and every unreferenced block holds ``garbage``. ``logical`` (optional) gives the
    K/V token values ``[(k [L, H_kv, D], v [L, H_kv, D_v]), ...]`` so several block sizes can store the same tokens.
    """
    d_v = d if d_v is None else d_v
    g = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    need = [-(-n // block_size) for n in seq_lens]
    shared = shared_prefix_blocks if sum(n > shared_prefix_blocks for n in need) >= 2 else 0
    distinct = sum(need) - shared * (sum(n > shared for n in need) - 1) if shared else sum(need)
    num_blocks = distinct + 3  # 3 blocks nobody references
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((batch, max(need + [0]) + 2), -1, dtype=torch.int32)
    prefix = perm[:shared]
    nxt = shared
    for b, n in enumerate(need):
        for j in range(n):
            if shared and j < shared and n > shared:
                table[b, j] = prefix[j]
            else:
                table[b, j] = perm[nxt]
                nxt += 1
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    k_cache, v_cache = alloc_caches(num_blocks, block_size, h_kv, d, d_v, cache_dtype, layout, garbage)
    k_scale = v_scale = None
    if cache_dtype == FP8:
        n_sc = h_kv if scale_per_head else 1
        k_scale = torch.rand(n_sc, generator=g) * 0.02 + 0.01
        v_scale = torch.rand(n_sc, generator=g) * 0.02 + 0.01
    for b, n in enumerate(seq_lens):
        if logical is not None:
            k_tok, v_tok = logical[b]
        else:
            k_tok = torch.randn(n, h_kv, d, generator=g)
            v_tok = torch.randn(n, h_kv, d_v, generator=g)
        if k_scale is not None:  # quantize as kvops.paged_cache_write does: x / scale, saturated
            k_tok = (k_tok / k_scale.view(1, -1, 1)).clamp(-448, 448)
            v_tok = (v_tok / v_scale.view(1, -1, 1)).clamp(-448, 448)
        pos = torch.arange(n)
        blk, row = table[b, pos // block_size].long(), pos % block_size
        k_cache[blk, row] = k_tok.to(cache_dtype)
        v_cache[blk, row] = v_tok.to(cache_dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    num_tokens = int(cu[-1])
    if layout == "separate":
        q = torch.randn(num_tokens, h_q, d, generator=g).to(dtype)
    else:  # q as a strided slice (e.g. of a fused qkv projection)
        q = torch.randn(num_tokens, h_q + 3, d + 5, generator=g).to(dtype)[:, 2 : 2 + h_q, :d]
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table, max_seqlen_q=max(q_lens + [1]), k_scale=k_scale, v_scale=v_scale,
        sinks=torch.randn(h_q, generator=g) if sinks else None,
    )


def ref_kwargs(inputs, **options):
    keys = ("q", "k_cache", "v_cache", "cu_seqlens_q", "seq_lens", "block_table", "sinks", "k_scale", "v_scale")
    return {**{k: inputs[k] for k in keys}, **options}


@contextmanager
def tile_budget(elements):
    """Force the CPU kernel to tile the context finely (many online-softmax steps)."""
    old = cpu_kernel._TILE_BUDGET
    cpu_kernel._TILE_BUDGET = elements
    try:
        yield
    finally:
        cpu_kernel._TILE_BUDGET = old


# --- the sampled matrix --------------------------------------------------------------------------------------------
BLOCK_SIZES = (1, 16, 128)
HEADS = ((4, 4), (8, 2), (5, 1), (14, 2), (28, 4))
DIMS = ((64, 64), (80, 80), (128, 128), (256, 256), (64, 32), (80, 128))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = ("separate", "joint", "outer", "padded")
FEATURES = ("plain", "window", "softcap", "sinks", "noncausal", "fp8", "window+softcap+sinks", "fp8_per_head+window")
Q_PATTERNS = ((1,), (3,), (17,), (1, 3, 17))
NUM_CASES = 24


def _balanced(values, n, rng):
    out = [values[i % len(values)] for i in range(n)]
    rng.shuffle(out)
    return out


def sample_cases(n=NUM_CASES, seed=2024):
    """``n`` cases in which every value of every axis appears (balanced shuffles, deterministic)."""
    rng = random.Random(seed)
    axes = [_balanced(v, n, rng) for v in (BLOCK_SIZES, HEADS, DIMS, DTYPES, LAYOUTS, FEATURES, Q_PATTERNS)]
    cases = []
    for i, (bs, heads, dims, dtype, layout, feature, q_pattern) in enumerate(zip(*axes)):
        seq_lens = [1, bs, bs + 1, 37] + ([1000 + 31 * (i % 3) + 1] if i % 2 == 0 else []) + ([0] if i % 3 == 0 else [])
        rng.shuffle(seq_lens)
        q_lens = [min(q_pattern[b % len(q_pattern)], n_kv) for b, n_kv in enumerate(seq_lens)]
        name = (f"{i:02d}_bs{bs}_h{heads[0]}x{heads[1]}_d{dims[0]}v{dims[1]}_{str(dtype)[6:]}_{layout}_"
                f"{feature.replace('+', '_')}_q{'-'.join(map(str, q_pattern))}")
        cases.append((name, dict(bs=bs, heads=heads, dims=dims, dtype=dtype, layout=layout, feature=feature,
                                 seq_lens=seq_lens, q_lens=q_lens, shared=1 if i % 4 == 1 else 0,
                                 fine_tiles=i % 5 == 2, seed=i)))
    return cases


def run_case(test, c):
    feature = c["feature"]
    inputs = make_inputs(
        c["seed"], c["seq_lens"], c["q_lens"], block_size=c["bs"], h_q=c["heads"][0], h_kv=c["heads"][1],
        d=c["dims"][0], d_v=c["dims"][1], dtype=c["dtype"], cache_dtype=FP8 if "fp8" in feature else None,
        layout=c["layout"], shared_prefix_blocks=c["shared"], scale_per_head="per_head" in feature,
        sinks="sinks" in feature,
    )
    options = dict(
        causal="noncausal" not in feature,
        window_left=5 + c["bs"] // 2 if "window" in feature else -1,
        softcap=7.5 if "softcap" in feature else 0.0,
    )
    with tile_budget(1) if c["fine_tiles"] else tile_budget(cpu_kernel._TILE_BUDGET):
        out, lse = kvops.paged_attention(**inputs, **options, return_lse=True)
    ref_out, ref_lse = reference(**ref_kwargs(inputs, **options))
    check_close(test, out, lse, ref_out, ref_lse, inputs["q"].dtype)


def check_close(test, out, lse, ref_out, ref_lse, dtype):
    test.assertEqual(out.dtype, dtype)
    test.assertEqual(lse.dtype, torch.float32)
    test.assertEqual(out.shape, ref_out.shape)
    test.assertEqual(lse.shape, ref_lse.shape)
    test.assertTrue(torch.isfinite(out).all(), "NaN/inf reached the output")
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    test.assertTrue(torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=LSE_TOL, rtol=LSE_TOL)


class TestPagedAttentionMatrix(expecttest.TestCase):
    """One generated test per sampled case (names say the combination)."""

    def test_sample_covers_every_value(self):
        cases = [c for _, c in sample_cases()]
        for key, values in (("bs", BLOCK_SIZES), ("heads", HEADS), ("dims", DIMS), ("dtype", DTYPES),
                            ("layout", LAYOUTS), ("feature", FEATURES)):
            self.assertEqual({c[key] for c in cases}, set(values), key)
        lens = {n for c in cases for n in c["seq_lens"]}
        self.assertTrue({0, 1, 16, 17, 128, 129, 2} <= lens and max(lens) > 1000)
        self.assertTrue({0, 1, 3, 17} <= {q for c in cases for q in c["q_lens"]})


for _name, _case in sample_cases():
    setattr(TestPagedAttentionMatrix, f"test_{_name}", lambda self, c=_case: run_case(self, c))


# --- targeted behaviour --------------------------------------------------------------------------------------------
class TestPagedAttentionCPU(expecttest.TestCase):
    def test_independent_of_block_size(self):
        g = torch.Generator().manual_seed(7)
        seq_lens, q_lens = [300, 1, 129, 0], [17, 1, 3, 0]
        logical = [(torch.randn(n, 2, 64, generator=g), torch.randn(n, 2, 64, generator=g)) for n in seq_lens]
        outs = []
        for bs in (1, 16, 128):
            inputs = make_inputs(3, seq_lens, q_lens, block_size=bs, h_q=14, h_kv=2, d=64, logical=logical)
            inputs["q"] = torch.randn(21, 14, 64, generator=torch.Generator().manual_seed(11))
            outs.append(kvops.paged_attention(**inputs, window_left=100, return_lse=True))
        ref_out, ref_lse = reference(**ref_kwargs(inputs, window_left=100))
        for out, lse in outs:
            check_close(self, out, lse, ref_out, ref_lse, torch.float32)
            torch.testing.assert_close(out, outs[0][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse, outs[0][1], atol=1e-5, rtol=1e-5)

    def test_garbage_never_reaches_output(self):
        for garbage in (float("nan"), float("inf"), float("-inf")):
            inputs = make_inputs(1, [5, 17, 33], [1, 3, 17], block_size=16, garbage=garbage, sinks=True)
            for fine in (False, True):
                with tile_budget(1 if fine else cpu_kernel._TILE_BUDGET):
                    out, lse = kvops.paged_attention(**inputs, return_lse=True)
                check_close(self, out, lse, *reference(**ref_kwargs(inputs)), torch.float32)

    def test_shared_prefix_and_permuted_table(self):
        inputs = make_inputs(5, [70, 64, 90], [3, 1, 17], block_size=16, h_q=8, h_kv=2, shared_prefix_blocks=3)
        table = inputs["block_table"]
        self.assertTrue(torch.equal(table[0, :3], table[1, :3]) and torch.equal(table[0, :3], table[2, :3]))
        out, lse = kvops.paged_attention(**inputs, return_lse=True)
        check_close(self, out, lse, *reference(**ref_kwargs(inputs)), torch.float32)

    def test_no_visible_keys_gives_zeros(self):
        # seq_len 0 with a query (position -1): nothing visible; also a batch whose only keys are all masked
        inputs = make_inputs(2, [0, 4], [1, 2], block_size=4, h_q=4, h_kv=2)
        out, lse = kvops.paged_attention(**inputs, return_lse=True)
        self.assertTrue(torch.equal(out[0], torch.zeros_like(out[0])))
        self.assertTrue(torch.isneginf(lse[:, 0]).all())
        self.assertTrue(torch.isfinite(lse[:, 1:]).all())
        sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
        out, lse = kvops.paged_attention(**{**inputs, "sinks": sinks}, return_lse=True)
        self.assertTrue(torch.equal(out[0], torch.zeros_like(out[0])))
        torch.testing.assert_close(lse[:, 0], sinks)  # the sink is the only term of the denominator

    def test_empty_batches(self):
        inputs = make_inputs(0, [5, 0], [0, 0], block_size=4)
        out, lse = kvops.paged_attention(**inputs, return_lse=True)
        self.assertEqual((tuple(out.shape), tuple(lse.shape)), ((0, 4, 16), (4, 0)))
        inputs = make_inputs(0, [], [], block_size=4)
        self.assertEqual(tuple(kvops.paged_attention(**inputs).shape), (0, 4, 16))

    def test_sinks_and_lse_identity(self):
        # out == sum_j exp(s_j - lse) v_j, with the sink only in the denominator
        inputs = make_inputs(9, [6], [2], block_size=4, h_q=2, h_kv=1, d=8, sinks=True)
        out, lse = kvops.paged_attention(**inputs, scale=0.7, return_lse=True)
        k = inputs["k_cache"][inputs["block_table"][0, :2].long()].flatten(0, 1)[:6, 0].double()
        v = inputs["v_cache"][inputs["block_table"][0, :2].long()].flatten(0, 1)[:6, 0].double()
        for i in range(2):
            pos = 4 + i
            for h in range(2):
                s = (k[: pos + 1] @ inputs["q"][i, h].double()) * 0.7
                want_lse = torch.logsumexp(torch.cat([s, inputs["sinks"][h].double().view(1)]), 0)
                torch.testing.assert_close(lse[h, i].double(), want_lse, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(out[i, h].double(), torch.exp(s - lse[h, i].double()) @ v[: pos + 1],
                                           atol=1e-5, rtol=1e-5)

    def test_qwen_decode_geometry_and_fine_tiles(self):
        # the LLM example's decode step: batch 8, context ~1000, Qwen2.5-0.5B heads 14/2 x 64, bf16
        seq_lens = [1000 + 7 * b for b in range(8)]
        inputs = make_inputs(4, seq_lens, [1] * 8, block_size=16, h_q=14, h_kv=2, d=64, dtype=torch.bfloat16)
        ref = reference(**ref_kwargs(inputs))
        check_close(self, *kvops.paged_attention(**inputs, return_lse=True), *ref, torch.bfloat16)
        with tile_budget(1):
            check_close(self, *kvops.paged_attention(**inputs, return_lse=True), *ref, torch.bfloat16)

    def test_default_returns_out_only(self):
        inputs = make_inputs(0, [3], [1], block_size=2)
        self.assertIsInstance(kvops.paged_attention(**inputs), torch.Tensor)

    def _opcheck(self, test_utils, **make):
        inputs = make_inputs(6, [9, 1, 0, 6], [3, 1, 0, 2], block_size=4, h_q=6, h_kv=2, d=8, sinks=True,
                             layout="joint", **make)
        args = (inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["cu_seqlens_q"], inputs["seq_lens"],
                inputs["block_table"], inputs["max_seqlen_q"])
        kwargs = dict(scale=0.3, causal=True, window_left=4, softcap=5.0, sinks=inputs["sinks"],
                      k_scale=inputs["k_scale"], v_scale=inputs["v_scale"])
        torch.library.opcheck(torch.ops.kvops.paged_attention.default, args, kwargs, test_utils=test_utils)

    def test_opcheck(self):
        self._opcheck(("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))

    def test_opcheck_fp8(self):
        # test_schema is left out: its mutation check calls torch.allclose, which has no float8 CPU kernel
        self._opcheck(("test_faketensor", "test_aot_dispatch_dynamic"), cache_dtype=FP8, scale_per_head=True)

    def test_export_keeps_the_op(self):
        inputs = make_inputs(8, [9, 4], [3, 1], block_size=4, h_q=4, h_kv=2, d=8)

        class Attn(torch.nn.Module):
            def forward(self, q, k_cache, v_cache, cu, seq_lens, table):
                return kvops.paged_attention(q, k_cache, v_cache, cu, seq_lens, table, 3, window_left=2)

        args = tuple(inputs[k] for k in ("q", "k_cache", "v_cache", "cu_seqlens_q", "seq_lens", "block_table"))
        ep = torch.export.export(Attn(), args)
        self.assertIn("kvops.paged_attention", str(ep.graph))
        torch.testing.assert_close(ep.module()(*args), Attn()(*args))

    def test_compiled_decode_loop_compiles_at_most_twice(self):
        torch._dynamo.reset()
        seq0 = [40, 1, 17, 64, 33, 5, 90, 120]
        inputs = make_inputs(12, [n + 20 for n in seq0], [1] * 8, block_size=16, h_q=14, h_kv=2, d=64)
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")  # traces the CPU kernel into the graph

        @torch.compile(backend=counter, fullgraph=True)
        def step(q, k_cache, v_cache, cu, seq_lens, table):
            return kvops.paged_attention(q, k_cache, v_cache, cu, seq_lens, table, 1, window_left=48,
                                         return_lse=True)

        seq_lens = torch.tensor(seq0, dtype=torch.int32)
        args = [inputs[k] for k in ("q", "k_cache", "v_cache", "cu_seqlens_q")]
        for _ in range(20):
            seq_lens = seq_lens + 1  # growing lengths, a new tensor every step
            out, lse = step(*args, seq_lens, inputs["block_table"])
            want_out, want_lse = kvops.paged_attention(*args, seq_lens, inputs["block_table"], 1, window_left=48,
                                                       return_lse=True)
            torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-6)
        self.assertLessEqual(counter.frame_count, 2)


# --- contract errors -----------------------------------------------------------------------------------------------
def _base(**overrides):
    inputs = make_inputs(0, [5, 3], [2, 1], block_size=4, h_q=4, h_kv=2, d=8)
    inputs.update(overrides)
    return inputs


ARG_ORDER = ("q", "k_cache", "v_cache", "cu_seqlens_q", "seq_lens", "block_table")


def _call(inputs, **options):
    """(fn, tensor args) for raises_everywhere; optional tensors and scalars are closed over."""
    extra = {k: inputs[k] for k in ("sinks", "k_scale", "v_scale")}
    max_seqlen_q = inputs["max_seqlen_q"]
    return (lambda *a: kvops.paged_attention(*a, max_seqlen_q, **extra, **options)), tuple(inputs[k] for k in ARG_ORDER)


class TestPagedAttentionErrors(expecttest.TestCase):
    def raises(self, inputs, exc=ValueError, **options):
        fn, args = _call(inputs, **options)
        return raises_everywhere(self, exc, fn, args)

    def test_v_cache_missing(self):
        inputs = _base()
        fn = lambda q, k, cu, sl, bt: kvops.paged_attention(q, k, None, cu, sl, bt, 2)  # noqa: E731
        args = tuple(inputs[k] for k in ("q", "k_cache", "cu_seqlens_q", "seq_lens", "block_table"))
        self.assertExpectedInline(raises_everywhere(self, ValueError, fn, args), """kvops.paged_attention: v_cache must be provided (the V cache written or read with k_cache).""")

    def test_heads_not_multiple(self):
        inputs = _base(q=torch.randn(3, 5, 8))
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: num_heads (5) must be a multiple of num_kv_heads (2) (GQA: query head h reads KV head h // (num_heads // num_kv_heads)). If the cache was allocated with another head count than the model's, allocate it with the model's num_kv_heads (a divisor of 5); else pass q with a multiple of 2 heads.""")

    def test_head_dim_mismatch(self):
        inputs = _base(q=torch.randn(3, 4, 16))
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: head_dim mismatch: q has shape (3, 4, 16) (head_dim 16) but k_cache has shape (6, 4, 2, 8) (head_dim 8).""")

    def test_q_rank(self):
        inputs = _base(q=torch.randn(1, 3, 4, 8))
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: q must be 3-D [num_tokens, num_heads, head_dim], got shape (1, 3, 4, 8). Reshape q to [num_tokens, num_heads, head_dim].""")

    def test_q_dtype_unsupported(self):
        base = _base()
        inputs = _base(q=base["q"].double(), k_cache=base["k_cache"].double(), v_cache=base["v_cache"].double())
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: q dtype torch.float64 is not supported; pass q as float32, bfloat16 or float16.""")

    def test_cache_dtype_mismatch(self):
        inputs = _base()
        inputs["q"] = inputs["q"].bfloat16()
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: k_cache dtype torch.float32 does not match q dtype torch.bfloat16. Caches must have q's dtype or be torch.float8_e4m3fn (with k_scale/v_scale); cast q or allocate the caches as torch.bfloat16.""")

    def test_kv_cache_dtype_mismatch(self):
        inputs = _base()
        inputs["v_cache"] = inputs["v_cache"].bfloat16()
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: v_cache dtype torch.bfloat16 does not match k_cache dtype torch.float32. Cast v_cache to torch.float32.""")

    def test_block_size_mismatch(self):
        inputs = _base()
        inputs["v_cache"] = inputs["v_cache"][:, :2]
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: k_cache shape (6, 4, 2, 8) and v_cache shape (6, 2, 2, 8) must agree in [num_blocks, block_size, num_kv_heads]; only head_dim may differ.""")

    def test_num_blocks_mismatch(self):
        inputs = _base()
        inputs["v_cache"] = inputs["v_cache"][:4]
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: k_cache shape (6, 4, 2, 8) and v_cache shape (4, 4, 2, 8) must agree in [num_blocks, block_size, num_kv_heads]; only head_dim may differ.""")

    def test_cache_rank(self):
        inputs = _base()
        inputs["k_cache"] = inputs["k_cache"].flatten(0, 1)
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: k_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], got shape (24, 2, 8). Reshape k_cache to [num_blocks, block_size, num_kv_heads, head_dim].""")

    def test_block_table_dtype(self):
        inputs = _base()
        inputs["block_table"] = inputs["block_table"].long()
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: block_table must be a 2-D int32 tensor [batch, max_blocks_per_seq], got shape (2, 4) and dtype torch.int64. Pass block_table.to(torch.int32).""")

    def test_seq_lens_dtype(self):
        inputs = _base()
        inputs["seq_lens"] = inputs["seq_lens"].long()
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: seq_lens must be a 1-D int32 tensor [batch], got shape (2,) and dtype torch.int64. Pass seq_lens.to(torch.int32).""")

    def test_cu_seqlens_q_dtype(self):
        inputs = _base()
        inputs["cu_seqlens_q"] = inputs["cu_seqlens_q"].long()
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: cu_seqlens_q must be a 1-D int32 tensor [batch + 1], got shape (3,) and dtype torch.int64. Pass cu_seqlens_q.to(torch.int32).""")

    def test_index_rank(self):
        inputs = _base()
        inputs["seq_lens"] = inputs["seq_lens"].view(2, 1)
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: seq_lens must be a 1-D int32 tensor [batch], got shape (2, 1) and dtype torch.int32. Reshape seq_lens to [batch].""")

    def test_batch_mismatch_seq_lens(self):
        inputs = _base()
        inputs["seq_lens"] = torch.tensor([5, 3, 1], dtype=torch.int32)
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: inconsistent batch size: block_table has 2 rows, seq_lens has 3 entries and cu_seqlens_q has 3; expected seq_lens [B] and cu_seqlens_q [B + 1] for block_table [B, max_blocks_per_seq].""")

    def test_batch_mismatch_cu_seqlens(self):
        inputs = _base()
        inputs["cu_seqlens_q"] = inputs["cu_seqlens_q"][1:]
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: inconsistent batch size: block_table has 2 rows, seq_lens has 2 entries and cu_seqlens_q has 2; expected seq_lens [B] and cu_seqlens_q [B + 1] for block_table [B, max_blocks_per_seq].""")

    def test_sinks_shape(self):
        inputs = _base(sinks=torch.zeros(2))
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: sinks must be a float32 tensor of shape [4] (one logit per query head), got shape (2,) and dtype torch.float32.""")

    def test_sinks_dtype(self):
        inputs = _base(sinks=torch.zeros(4, dtype=torch.bfloat16))
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: sinks must be a float32 tensor of shape [4] (one logit per query head), got shape (4,) and dtype torch.bfloat16.""")

    def test_fp8_without_scales(self):
        inputs = make_inputs(0, [5, 3], [2, 1], block_size=4, h_q=4, h_kv=2, d=8, cache_dtype=FP8)
        inputs["v_scale"] = None
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: a torch.float8_e4m3fn cache needs k_scale and v_scale (float32, shape [1] or [2]); the cache holds x / scale. Pass both scales.""")

    def test_scale_shape(self):
        inputs = make_inputs(0, [5, 3], [2, 1], block_size=4, h_q=4, h_kv=2, d=8, cache_dtype=FP8)
        inputs["k_scale"] = torch.ones(3)
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: k_scale must be a float32 tensor of shape [1] (per tensor) or [2] (per KV head of the cache), got shape (3,) and dtype torch.float32.""")

    def test_scales_without_fp8(self):
        inputs = _base(k_scale=torch.ones(1), v_scale=torch.ones(1))
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: k_scale/v_scale were given but the cache dtype is torch.float32; scales apply only to torch.float8_e4m3fn caches. Drop the scales or allocate the caches as torch.float8_e4m3fn.""")

    def test_max_seqlen_q_zero(self):
        inputs = _base(max_seqlen_q=0)
        self.assertExpectedInline(self.raises(inputs), """kvops.paged_attention: max_seqlen_q must be >= 1 (the longest query length in the batch) when q has tokens, got 0 for 3 tokens.""")

    def test_window_and_softcap(self):
        self.assertExpectedInline(self.raises(_base(), window_left=-2), """kvops.paged_attention: window_left must be -1 (no window) or >= 0, got -2.""")
        self.assertExpectedInline(self.raises(_base(), softcap=-1.0), """kvops.paged_attention: softcap must be >= 0 (0 disables it), got -1.0.""")


if __name__ == "__main__":
    unittest.main()

"""Triton kernels of the MLA ops (kvops/triton/mla.py), run on CPU tensors in the Triton interpreter.

The launchers are called directly (as tests/paged/test_paged_attention_triton.py does). Small shapes (kv_lora_rank 32,
rope 16, 4 heads); block tables are permuted and every cache row no sequence owns holds NaN, so a kernel that reads
past ``seq_len`` or an unused table entry fails. Reference: the fp64 oracle ``kvops/reference/mla.py``.
With CUDA the same tests run on CUDA tensors.
"""

import os
import unittest

import torch

if not torch.cuda.is_available():  # before triton.jit decorates the kernels (tests/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvops.reference import mla as oracle  # noqa: E402
from kvops.triton import mla as tri  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
RANK, ROPE = 32, 16


def to_dev(*ts):
    return [None if t is None else t.to(DEVICE) for t in ts]


def bits(t):
    """The bytes of ``t`` (NaN payloads compared, NaN == NaN)."""
    return t.cpu().contiguous().view(torch.uint8)


# --- write -------------------------------------------------------------------------------------------------------
def nan_cache(p, block_size, dtype):
    return torch.full((p, block_size, RANK + ROPE), float("nan")).to(dtype)


class TestMlaWriteTriton(unittest.TestCase):
    def check(self, n, n_pad, p, block_size, dtype, cache_dtype=None, scale=None, rotary=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        cache_dtype = cache_dtype or dtype
        mag = 200.0 if cache_dtype == FP8 else 1.0
        kv_c = (torch.randn(n_pad, RANK, generator=g) * mag).to(dtype)
        k_pe = (torch.randn(n_pad, ROPE, generator=g) * mag).to(dtype)
        slots = torch.randperm(p * block_size, generator=g)[:n]
        slots[::3] = -1  # padding
        cache = nan_cache(p, block_size, cache_dtype)
        kv_scale = None if scale is None else torch.tensor(scale, dtype=torch.float32)
        positions = cos = sin = None
        interleaved = rotary == "gptj"
        if rotary is not None:
            half = ROPE // 2 if rotary != "partial" else ROPE // 4
            positions = torch.randint(0, 40, (n_pad,), generator=g)
            ang = torch.arange(40.0)[:, None] / (10000 ** (torch.arange(half) / half))
            cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        want = oracle.mla_cache_write(kv_c, k_pe, cache, slots, kv_scale, positions, cos, sin, interleaved)
        got = cache.to(DEVICE)
        tri.mla_cache_write(*to_dev(kv_c, k_pe), got, *to_dev(slots, kv_scale, positions, cos, sin), interleaved)
        got = got.cpu()
        self.assertTrue(torch.equal(bits(got[..., :RANK]), bits(want[..., :RANK])))  # bit-exact, NaN untouched
        if rotary is None:
            self.assertTrue(torch.equal(bits(got), bits(want)))
        else:  # the rotation rounded to k_pe's dtype (and then fp8) may land one code apart: fp32 math (an FMA on
            # the GPU) against the oracle's fp64, and the interpreter's fp32 -> bf16/fp16 cast truncates
            self.assertTrue(torch.equal(got.float().isnan(), want.float().isnan()))
            g_pe, w_pe = got[..., RANK:].float().nan_to_num(0.0), want[..., RANK:].float().nan_to_num(0.0)
            step = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -22}[dtype]
            step = 2.0 ** -3 if cache_dtype == FP8 else step
            self.assertTrue(bool(((g_pe - w_pe).abs() <= w_pe.abs() * step + 2.0 ** -9).all()))

    def test_plain_write_block_sizes_and_dtypes(self):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for block_size in (1, 16):
                self.check(9, 11, 24 // block_size + 1, block_size, dtype)

    def test_rotary_neox_gptj_partial(self):
        for rotary in ("neox", "gptj", "partial"):
            self.check(7, 7, 3, 16, torch.bfloat16, rotary=rotary, seed=1)
        self.check(5, 6, 8, 1, torch.float32, rotary="gptj", seed=2)

    def test_fp8_cache_per_tensor_scale_saturates(self):
        self.check(8, 8, 2, 16, torch.bfloat16, FP8, scale=0.25, seed=3)  # |x| / 0.25 beyond 448: saturated
        self.check(6, 9, 7, 1, torch.float16, FP8, scale=1.5, rotary="neox", seed=4)

    def test_empty_and_all_padding(self):
        cache = nan_cache(2, 16, torch.float32).to(DEVICE)
        kv_c, k_pe = torch.ones(3, RANK, device=DEVICE), torch.ones(3, ROPE, device=DEVICE)
        tri.mla_cache_write(kv_c, k_pe, cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
        tri.mla_cache_write(kv_c, k_pe, cache, torch.full((3,), -1, dtype=torch.int32, device=DEVICE))
        self.assertTrue(cache.isnan().all())

    def test_source_aliasing_the_cache_is_read_first(self):
        cache = torch.randn(2, 4, RANK + ROPE).to(DEVICE)
        flat = cache.view(8, RANK + ROPE)
        want = cache.clone()
        want.view(8, -1)[[1, 0]] = flat[[0, 1]]  # rows 0 and 1 swapped
        tri.mla_cache_write(flat[:2, :RANK], flat[:2, RANK:], cache, torch.tensor([1, 0], device=DEVICE))
        self.assertTrue(torch.equal(cache, want))


# --- attention ---------------------------------------------------------------------------------------------------
def make_attention(seed, seq_lens, q_lens, block_size, heads=4, dtype=torch.float32, cache_dtype=None):
    """Packed queries, a permuted block table (-1 past each sequence) and a cache whose unowned rows are NaN."""
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    blocks = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(max(blocks), 1) + 1
    p = sum(blocks) + 2
    perm = torch.randperm(p, generator=g).tolist()
    table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    cache = torch.full((p, block_size, RANK + ROPE), float("nan"))
    k = 0
    for b, (s, nb) in enumerate(zip(seq_lens, blocks)):
        for j in range(nb):
            table[b, j] = perm[k]
            rows = min(block_size, s - j * block_size)
            cache[perm[k], :rows] = torch.randn(rows, RANK + ROPE, generator=g)
            k += 1
    kv_scale = None
    if cache_dtype == FP8:
        kv_scale = torch.tensor(0.05)
        cache = (cache / kv_scale).clamp(-448, 448)
    cache = cache.to(cache_dtype)
    total = sum(q_lens)
    q = torch.randn(total + 1, heads, RANK + ROPE, generator=g).to(dtype)  # one row past cu[-1]: no sequence
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(q=q, kv_cache=cache, cu_seqlens_q=cu, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                block_table=table, max_seqlen_q=max(max(q_lens), 1), kv_scale=kv_scale)


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


class TestMlaAttentionTriton(unittest.TestCase):
    def check(self, inputs, causal=True, **launch):
        scale = (RANK + ROPE) ** -0.5
        args = to_dev(inputs["q"], inputs["kv_cache"], inputs["cu_seqlens_q"], inputs["seq_lens"],
                      inputs["block_table"])
        out, lse = tri.mla_attention(*args, inputs["max_seqlen_q"], RANK, scale, causal,
                                     *to_dev(inputs["kv_scale"]), **launch)
        want_out, want_lse = oracle.mla_attention(inputs["q"], inputs["kv_cache"], inputs["cu_seqlens_q"],
                                                  inputs["seq_lens"], inputs["block_table"], RANK, scale, causal,
                                                  inputs["kv_scale"])
        self.assertEqual(out.dtype, inputs["q"].dtype)
        self.assertEqual(tuple(lse.shape), (inputs["q"].shape[1], inputs["q"].shape[0]))
        tol = TOLERANCE[inputs["q"].dtype]
        torch.testing.assert_close(out.cpu().double(), want_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.cpu().double(), want_lse, atol=tol, rtol=tol)
        return out.cpu(), lse.cpu()

    def test_chunked_prefill_mixed_with_decode(self):
        for block_size in (1, 16):
            inputs = make_attention(0, [37, 5, 1, 20], [7, 1, 1, 20], block_size)
            for causal in (True, False):
                self.check(inputs, causal=causal, block_n=16, block_m=16)

    def test_decode_splits_and_merge(self):
        inputs = make_attention(1, [45, 3, 17, 0], [1, 1, 1, 0], 4)
        for num_splits in (None, 1, 3):
            self.check(inputs, num_splits=num_splits, block_n=16)

    def test_empty_sequences_and_queries_without_keys(self):
        """seq_len 0 with queries (no key: 0 and -inf), a sequence of no queries, q_len > seq_len under causal
        (the first queries sit at negative positions), the row past cu_seqlens_q[-1]."""
        inputs = make_attention(2, [0, 6, 2, 9], [2, 0, 4, 3], 16)
        out, lse = self.check(inputs, block_n=16, block_m=16)
        self.assertTrue((out[:2] == 0).all() and lse[:, :2].isneginf().all())
        self.assertTrue((out[2:4] == 0).all() and lse[:, 2:4].isneginf().all())  # positions -2, -1
        self.assertTrue((out[-1] == 0).all() and lse[:, -1].isneginf().all())

    def test_half_precision(self):
        for dtype in (torch.bfloat16, torch.float16):
            self.check(make_attention(3, [30, 8], [4, 1], 16, dtype=dtype), block_n=16, block_m=16)
            self.check(make_attention(4, [19, 33, 2], [1, 1, 1], 1, heads=5, dtype=dtype), num_splits=2, block_n=16)

    def test_fp8_cache_with_per_tensor_scale(self):
        for q_lens, dtype in (([3, 1], torch.bfloat16), ([1, 1], torch.bfloat16), ([2, 2], torch.float32)):
            inputs = make_attention(5, [26, 11], q_lens, 16, dtype=dtype, cache_dtype=FP8)
            self.check(inputs, block_n=16, block_m=16, num_splits=2)

    def test_strided_q_and_cache(self):
        """q a column slice of a wider tensor with heads outermost; the cache a column slice of a wider allocation."""
        inputs = make_attention(6, [21, 4], [3, 1], 16)
        t, h, w = inputs["q"].shape
        wide_q = torch.randn(h, t, w + 5)
        wide_q[..., :w] = inputs["q"].transpose(0, 1)
        inputs["q"] = wide_q[..., :w].transpose(0, 1)
        p, bs, _ = inputs["kv_cache"].shape
        wide_c = torch.full((p, bs, w + 8), float("nan"))
        wide_c[..., 3:w + 3] = inputs["kv_cache"]
        inputs["kv_cache"] = wide_c[..., 3:w + 3]
        self.check(inputs, block_n=16, block_m=16)

    def test_real_geometry_tiles_plan(self):
        """DeepSeek's geometry on meta tensors: the planned tiles and grids (the AOT check compiles them)."""
        meta = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
        q, cache = meta(32, 128, 576), meta(2048, 64, 576)
        i32 = torch.int32
        launches, out, lse = tri.plan_mla_attention(q, cache, meta(33, dt=i32), meta(32, dt=i32),
                                                    meta(32, 64, dt=i32), 1, 512, 576 ** -0.5, True, None, (9, 0))
        (launch,) = launches  # 32 sequences x 8 head blocks fill the GPU: no split
        self.assertEqual(launch.grid, (1, 32, 8))
        self.assertEqual((launch.constexprs["BLOCK_H"], launch.constexprs["BLOCK_R"], launch.constexprs["BLOCK_P"]),
                         (16, 512, 64))
        self.assertEqual((tuple(out.shape), tuple(lse.shape)), ((32, 128, 512), (128, 32)))
        launches, _, _ = tri.plan_mla_attention(meta(1, 128, 576), cache, meta(2, dt=i32), meta(1, dt=i32),
                                                meta(1, 2048, dt=i32), 1, 512, 1.0, True, None, (9, 0))
        self.assertEqual([la.kernel for la in launches], [tri._mla_attention_kernel, tri._decode_merge_kernel])
        self.assertEqual(launches[0].grid, (1, 1, 8 * 32))  # one sequence at 128K: 32 splits per head block


class TestMlaCudaRegistration(unittest.TestCase):
    def test_the_ops_dispatch_cuda_tensors_to_these_kernels(self):
        import kvops.ops.mla as ops

        for name in ("mla_cache_write", "mla_attention"):
            self.assertTrue(torch._C._dispatch_has_kernel_for_dispatch_key(f"kvops::{name}", "CUDA"), name)
        self.assertIs(ops._triton_mla, tri)


if __name__ == "__main__":
    unittest.main()

"""Inductor lowering of kvops.mla_cache_write (lowering/inductor_mla.py), on CPU.

Checked against eager (the kvops CPU kernel) bit for bit on the whole cache, whose unwritten rows hold random bits
(NaN payloads included), and by reading the generated code: the producers of ``kv_c``/``k_pe`` (the ``kv_a_proj``
output split, a norm, RoPE, fp8 quantization) and the stores are one C++ kernel besides the matmul, with no extern
call to kvops.
"""

import torch
import torch._dynamo
import torch._inductor.config
from torch._dynamo.testing import CompileCounterWithBackend

from kvops.ops.mla import mla_cache_write
from tests.inductor_utils import FreshInductorCache, code_facts, compiled

FP8 = torch.float8_e4m3fn
RANK, ROPE = 32, 16


def random_bits(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=g)
    return bits.view(dtype).view(shape)


def same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def projected_write(x, w, cache, slot_mapping, kv_scale=None, positions=None, cos=None, sin=None, interleaved=False):
    """DeepSeek's ``kv_a_proj_with_mqa`` output split into the latent and the rope part, the latent scaled (a
    norm's weight; the norm's own reduction would round differently compiled), then written."""
    kv = x @ w
    kv_c, k_pe = kv[:, :RANK], kv[:, RANK:]
    kv_c = (kv_c.float() * 1.5).to(x.dtype)
    mla_cache_write(kv_c, k_pe, cache, slot_mapping, kv_scale, positions, cos, sin, interleaved)


def tables(rows, half, dtype):
    ang = torch.arange(rows, dtype=torch.float32)[:, None] / (10000 ** (torch.arange(half) / half))
    return ang.cos().to(dtype), ang.sin().to(dtype)


class TestMlaWriteLowering(FreshInductorCache):
    def run_case(self, dtype, cache_dtype, slots, block_size=4, num_blocks=5, rotary=None, kv_scale=None, rows=9):
        torch.manual_seed(0)
        x = torch.randn(rows, 24, dtype=dtype)
        w = (torch.randn(24, RANK + ROPE) * (40 if cache_dtype == FP8 else 1)).to(dtype)
        cache = random_bits((num_blocks, block_size, RANK + ROPE), cache_dtype, seed=1)
        expected = cache.clone()
        slot_mapping = torch.tensor(slots)
        extra = (kv_scale,)
        if rotary is not None:
            cos, sin = tables(rows, ROPE // 2 if rotary != "partial" else ROPE // 4, dtype)
            positions = torch.randperm(rows)
            extra = (kv_scale, positions, cos, sin, rotary == "gptj")
        with torch._inductor.config.patch(emulate_precision_casts=True):  # bf16 rounding before fp8, as eager
            _, code = compiled(projected_write, x, w, cache, slot_mapping, *extra)
        projected_write(x, w, expected, slot_mapping, *extra)
        self.assertTrue(same_bits(cache, expected))
        return code_facts(code)

    def test_write_fuses_with_the_projection_split_and_scale(self):
        """Padding before and between real slots, x with more rows than slot_mapping, int32 and int64 slots."""
        for dtype, index_dtype in ((torch.float32, torch.int32), (torch.bfloat16, torch.int64)):
            slots = torch.tensor([-1, 3, -1, 8, 6, 19, 0], dtype=index_dtype).tolist()
            facts = self.run_case(dtype, dtype, slots)
            self.assertEqual(facts, "cpp kernels: 1, kvops calls: 0")

    def test_rotary_neox_gptj_partial(self):
        for rotary in ("neox", "gptj", "partial"):
            facts = self.run_case(torch.bfloat16, torch.bfloat16, [4, -1, 17, 1, 0], rotary=rotary)
            self.assertEqual(facts, "cpp kernels: 1, kvops calls: 0", rotary)

    def test_fp8_cache_with_rotary_and_saturation(self):
        for kv_scale in (torch.tensor(0.5), torch.tensor([0.25])):  # 0-d and [1]; |x| / scale beyond 448 saturates
            facts = self.run_case(torch.bfloat16, FP8, [2, 11, -1, 7], rotary="neox", kv_scale=kv_scale,
                                  block_size=1, num_blocks=12)
            self.assertEqual(facts, "cpp kernels: 1, kvops calls: 0")

    def test_all_padding_leaves_the_cache_bit_identical(self):
        self.run_case(torch.bfloat16, torch.bfloat16, [-1, -1, -1])

    def test_token_count_is_dynamic(self):
        """Steps with 3, 5, 8, 4 tokens compile at most twice and match eager."""

        def write(kv_c, k_pe, cache, slot_mapping):
            mla_cache_write(kv_c * 2, k_pe, cache, slot_mapping)

        cache, ref = torch.zeros(8, 4, RANK + ROPE), torch.zeros(8, 4, RANK + ROPE)
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        step = torch.compile(write, backend=counter, fullgraph=True)
        g = torch.Generator().manual_seed(0)
        for n in (3, 5, 8, 4):
            slot_mapping = torch.randperm(32, generator=g)[:n]
            slot_mapping[::3] = -1
            kv_c, k_pe = torch.randn(n + 2, RANK, generator=g), torch.randn(n + 2, ROPE, generator=g)
            step(kv_c, k_pe, cache, slot_mapping)
            write(kv_c, k_pe, ref, slot_mapping)
            self.assertTrue(torch.equal(cache, ref), n)
        self.assertLessEqual(counter.frame_count, 2)

"""Triton kernel of kvops.paged_cache_write, bit-exact against the CPU kernel and a per-token reference.

Without CUDA the kernel runs in the Triton interpreter on CPU tensors. ``TRITON_INTERPRET=1`` must be set before
``triton.jit`` decorates the kernel; ``tests/conftest.py`` sets it for the whole pytest session (where there is no
GPU) and the ``setdefault`` below does the same when this file is run on its own. With CUDA (no interpreter) the same
tests run on CUDA tensors.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools  # noqa: E402
import unittest  # noqa: E402

import expecttest  # noqa: E402

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvops.cpu import paged_write as cpu_kernel  # noqa: E402
from kvops.triton import paged_write as triton_kernel  # noqa: E402
from tests.paged.test_paged_write import FP8, make_paged_caches, random_slots, ref_write  # noqa: E402

INTERPRETED = isinstance(triton_kernel._paged_scatter_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TestPagedWriteTriton(expecttest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not INTERPRETED and not torch.cuda.is_available():
            raise RuntimeError(
                "kvops.triton was imported before TRITON_INTERPRET=1 was set and there is no GPU: run this file with "
                "TRITON_INTERPRET=1 (tests/conftest.py sets it) or in a fresh process."
            )

    def run_both(self, p, bs, hkv, hin, d, dv, n, n_pad, pad, h0, dtype, layout, idx_dtype, scales=None):
        cache_dtype = FP8 if scales else dtype
        k_cache, v_cache = make_paged_caches(p, bs, hkv, d, dv, cache_dtype, layout)
        key = (torch.randn(n_pad, hin, d) * (100 if scales else 1)).to(dtype)
        value = torch.randn(n_pad, hin, dv).to(dtype)
        slots = random_slots(p, bs, n, pad, idx_dtype, seed=p * 7 + n)
        k_scale, v_scale = (None, None) if not scales else (torch.rand(scales) + 0.1, torch.rand(scales) + 0.01)
        want_k, want_v = ref_write(k_cache, v_cache, key, value, slots, h0, k_scale, v_scale)
        cpu_k, cpu_v = k_cache.clone(), v_cache.clone()
        cpu_kernel.paged_cache_write(key, value, cpu_k, cpu_v, slots, h0, k_scale, v_scale)
        to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
        if DEVICE != "cpu":
            k_cache, v_cache = make_paged_caches(p, bs, hkv, d, dv, cache_dtype, layout, DEVICE)
        triton_kernel.paged_cache_write(to(key), to(value), k_cache, v_cache, to(slots), h0, to(k_scale), to(v_scale))
        bits = lambda t: t.cpu().view(torch.uint8) if t.dtype == FP8 else t.cpu()  # noqa: E731
        for got, cpu, want in ((k_cache, cpu_k, want_k), (v_cache, cpu_v, want_v)):
            self.assertTrue(torch.equal(bits(got), bits(want)))
            self.assertTrue(torch.equal(bits(cpu), bits(want)))

    def test_matches_reference(self):
        cases = [  # (P, block_size, H_kv, H_in, D, D_v, N, N', pad, cache_head_start)
            (3, 4, 2, 2, 16, 16, 6, 6, 0, 0),
            (5, 1, 2, 2, 80, 80, 4, 5, 1, 0),  # block_size 1, head_dim 80, padded key
            (3, 4, 5, 1, 80, 80, 5, 5, 2, 4),  # GQA 5:1 group: last head of five, padding
            (3, 2, 3, 3, 8, 24, 3, 3, 3, 0),  # all padding, D_v != D
            (2, 4, 2, 2, 8, 8, 0, 2, 0, 0),  # zero tokens
            (2, 2, 40, 36, 256, 256, 3, 3, 1, 2),  # wide rows: several head blocks per token, the last partial
        ]
        for dtype, case in itertools.product(DTYPES, cases):
            d, dv = case[4], case[5]
            for layout in ("separate", "joint", "joint_blocks", "head_view") if d == dv else ("head_view",):
                idx = torch.int32 if layout != "joint" else torch.int64
                with self.subTest(dtype=dtype, case=case, layout=layout):
                    self.run_both(*case, dtype, layout, idx)

    def test_strided_slot_mapping(self):
        k_cache, v_cache = make_paged_caches(3, 4, 2, 16, 16, torch.float32, "separate", DEVICE)
        key, value = torch.randn(5, 2, 16, device=DEVICE), torch.randn(5, 2, 16, device=DEVICE)
        buf = torch.full((10,), -1, dtype=torch.int64, device=DEVICE)
        buf[::2] = torch.tensor([7, -1, 0, 11, 3])
        slots = buf[::2]  # stride 2
        want_k, want_v = ref_write(k_cache.cpu(), v_cache.cpu(), key.cpu(), value.cpu(), slots.cpu(), 0, None, None)
        triton_kernel.paged_cache_write(key, value, k_cache, v_cache, slots, 0, None, None)
        self.assertTrue(torch.equal(k_cache.cpu(), want_k) and torch.equal(v_cache.cpu(), want_v))

    def test_fp8(self):
        for src_dtype, (hkv, hin, h0, nscale, layout) in itertools.product(
            DTYPES, [(4, 4, 0, 1, "separate"), (4, 4, 0, 4, "joint"), (5, 1, 3, 5, "joint_blocks")]
        ):
            with self.subTest(src=src_dtype, case=(hkv, hin, h0, nscale, layout)):
                self.run_both(3, 4, hkv, hin, 16, 16, 6, 7, 1, h0, src_dtype, layout, torch.int64, scales=nscale)

    def test_fp8_encoding_every_value_and_tie(self):
        """The kernel's hand-written fp32->e4m3 encoding equals torch's ``clamp(-448, 448).to(float8_e4m3fn)``."""
        fp8 = torch.arange(256, dtype=torch.uint8).view(FP8).float()
        fp8 = fp8[~fp8.isnan()].sort().values
        mids = (fp8[1:] + fp8[:-1]) / 2  # ties: round to even
        up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
        g = torch.Generator().manual_seed(0)
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, 464.0, 1e30, 124.0])
        signs = torch.randint(0, 2, (1000,), generator=g) * 2 - 1
        log_uniform = torch.exp2(torch.rand(1000, generator=g) * 26 - 16) * signs
        vals = torch.cat([fp8, mids, mids.nextafter(up), mids.nextafter(down), special, log_uniform])
        d = 256
        rows = -(-vals.numel() // d)
        x = torch.cat([vals, torch.zeros(rows * d - vals.numel())]).view(rows, 1, d)
        cache = torch.zeros(rows, 1, 1, d, dtype=FP8, device=DEVICE)
        triton_kernel.scatter_tokens(x.to(DEVICE), cache, torch.arange(rows, device=DEVICE), 0,
                                     torch.ones(1, device=DEVICE))
        want = x.clamp(-448, 448).to(FP8).view(torch.uint8)
        self.assertTrue(torch.equal(cache.cpu().view(torch.uint8).flatten(), want.flatten()))


if __name__ == "__main__":
    unittest.main()

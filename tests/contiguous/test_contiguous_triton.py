"""Triton kernels of the contiguous ops, called directly (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""

import itertools
import os
import unittest

import torch

from tests.contiguous.test_contiguous_ops import make_caches, ref_roll, ref_write

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class TestTritonContiguous(unittest.TestCase):
    def setUp(self):
        # without a GPU the kernels must run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
        self.assertTrue(DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")

    def test_write(self):
        from kvops.triton import contiguous as tk

        cases = [  # (H_cache, H_in, D, D_v, start, T, h0, layout)
            (4, 4, 80, 80, 2, 3, 0, "separate"),
            (5, 1, 16, 24, 0, 4, 3, "separate"),
            (4, 2, 16, 16, 5, 3, 2, "joint"),
            (3, 3, 8, 8, 1, 2, 0, "head_slice"),
            (40, 36, 256, 256, 3, 2, 3, "separate"),  # wide rows: several head blocks per token, the last partial
        ]
        for dtype, (hc, hi, d, dv, start, t, h0, layout) in itertools.product(
            (torch.float32, torch.bfloat16), cases
        ):
            k_cache, v_cache = make_caches(2, 8, hc, d, dv, dtype, layout, DEVICE)
            key = torch.randn(2, t, hi, d).to(DEVICE, dtype)
            value = torch.randn(2, t, hi, dv).to(DEVICE, dtype)
            want_k, want_v = ref_write(k_cache, v_cache, key, value, start, h0)
            tk.cache_write(key, value, k_cache, v_cache, start, h0)
            self.assertTrue(torch.equal(k_cache, want_k), (dtype, layout))
            self.assertTrue(torch.equal(v_cache, want_v), (dtype, layout))

    def test_roll(self):
        from kvops.triton import contiguous as tk

        for src, dst, n, h0, h1 in [(5, 2, 6, 0, 3), (2, 5, 6, 1, 3), (8, 0, 4, 0, 3), (3, 3, 2, 0, 3), (1, 0, 0, 0, 3)]:
            k_cache, v_cache = make_caches(1, 12, 3, 16, 16, torch.float16, "joint", DEVICE)
            k_cache.copy_(torch.randn(k_cache.shape))
            v_cache.copy_(torch.randn(v_cache.shape))
            want_k, want_v = ref_roll(k_cache, src, dst, n, h0, h1), ref_roll(v_cache, src, dst, n, h0, h1)
            tk.cache_roll(k_cache, v_cache, src, dst, n, h0, h1)
            self.assertTrue(torch.equal(k_cache, want_k), (src, dst, n))
            self.assertTrue(torch.equal(v_cache, want_v), (src, dst, n))


if __name__ == "__main__":
    unittest.main()

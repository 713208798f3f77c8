"""Triton kernels of quantize_kv / dequantize_kv, called directly (CUDA, or CPU tensors under TRITON_INTERPRET=1):
codes equal to the CPU kernels', dequantized values equal up to fp32 rounding."""

from __future__ import annotations

import os
import unittest

import torch

from kvops.packed import empty_packed
from kvops.packed import reference as cpu
from tests.test_packed_ops import kv_like

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class TestTritonQuant(unittest.TestCase):
    def setUp(self):
        # without a GPU the kernels must run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
        self.assertTrue(DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")

    def test_quantize_and_dequantize_match_the_cpu_kernels(self):
        from kvops.packed import triton_quant as tk

        cases = [("int8", 80, None, 1, torch.bfloat16), ("int8", 64, None, 1, torch.float32),
                 ("int4", 64, 32, 1, torch.bfloat16), ("int4", 128, 128, 1, torch.float32),
                 ("int2", 64, 32, 2, torch.bfloat16)]
        for quant, d, group, stages, dtype in cases:
            x = kv_like(2, 3, 6, d, seed=d, dtype=dtype).to(DEVICE)[:, :, ::2]  # strided: every other head
            want = empty_packed(quant, 2, 3, 3, d, group_size=group, stages=stages, num_clusters=2)
            cpu.quantize(x.cpu(), *want[1:], quant, 2)
            got = empty_packed(quant, 2, 3, 3, d, group_size=group, stages=stages, num_clusters=2, device=DEVICE)
            tk.quantize(x, *got[1:], quant, 2)
            for a, b in zip(got.tensors(), want.tensors()):
                self.assertTrue(torch.equal(a.cpu(), b), (quant, d, dtype))
            out = tk.dequantize(*got[1:], quant, torch.float32)
            ref = cpu.dequantize(*want[1:], quant, torch.float32)
            torch.testing.assert_close(out.cpu(), ref, rtol=1e-6, atol=1e-6)
            self.assertEqual(tk.dequantize(*got[1:], quant, torch.bfloat16).dtype, torch.bfloat16)


if __name__ == "__main__":
    unittest.main()

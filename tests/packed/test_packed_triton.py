"""Triton kernels of quantize_kv / dequantize_kv, called directly (CUDA, or CPU tensors under TRITON_INTERPRET=1):
codes equal to the CPU kernels', dequantized values equal up to fp32 rounding."""

from __future__ import annotations

import os
import unittest

import torch

from kvops.packed import empty_packed
from kvops.cpu import packed as cpu
from tests.packed.test_packed_ops import kv_like

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class TestTritonQuant(unittest.TestCase):
    def setUp(self):
        # without a GPU the kernels must run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
        self.assertTrue(DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")

    def test_quantize_and_dequantize_match_the_cpu_kernels(self):
        from kvops.triton import packed_quant as tk

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


class TestTritonPackedAttention(unittest.TestCase):
    """The fused attention kernel (one launch per segment, packed tiles dequantized in registers) against the fp64
    reference over the fp32-dequantized window: every format, GQA 5:1, head_dim 80, 64 and 128, D_v != D, bf16,
    fp16, a zero-length segment, strided q and head-sliced segments."""

    def setUp(self):
        self.assertTrue(DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")

    def test_matches_the_reference(self):
        from kvops.triton import packed_attention as ta
        from kvops.ops.packed_attention import _split
        from tests.packed.test_packed_attention import dense_window, reference, window

        cases = [("int8", 1, 5, 80, None, {}, torch.float32), ("fp8", 2, 2, 64, None, {}, torch.bfloat16),
                 ("int4", 1, 5, 80, None, dict(group_size=80), torch.float32),
                 ("int4", 2, 4, 64, 32, dict(group_size=32), torch.float32),
                 ("int2", 1, 2, 64, None, dict(stages=2, num_clusters=4), torch.float32),
                 (None, 2, 4, 64, None, {}, torch.bfloat16),
                 (None, 1, 2, 128, None, {}, torch.float16)]  # dense 16-bit at 128: 32-token tiles (segment_launch)
        for quant, hkv, hq, d, d_v, fmt, dtype in cases:
            with self.subTest(quant=quant, d=d):
                ks, vs = window(quant, 2, hkv + 1, d, [5, 0, 19], d_v=d_v, seed=d, dtype=dtype, **fmt)
                ks = [k[:, :, 1:] if isinstance(k, torch.Tensor) else k.heads(1, hkv + 1) for k in ks]  # head slices
                vs = [v[:, :, 1:] if isinstance(v, torch.Tensor) else v.heads(1, hkv + 1) for v in vs]
                q = torch.randn(2, 3, 2 * hq, d)[:, :, ::2].to(dtype)  # strided: every other head
                kd, kp = _split(ks)
                vd, vp = _split(vs)
                move = lambda ts: [t.to(DEVICE) for t in ts]  # noqa: E731
                out, lse = ta.packed_attention(q.to(DEVICE), move(kd), move(vd), move(kp), move(vp), quant, 0.15)
                want, want_lse = reference(q, dense_window(ks), dense_window(vs), 0.15)
                tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(dtype, 1e-5)
                self.assertEqual(out.dtype, dtype)
                torch.testing.assert_close(out.cpu().double(), want, rtol=tol, atol=tol)
                torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    unittest.main()

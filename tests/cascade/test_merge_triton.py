"""Triton kernels of the merge (``kvops/triton/merge.py``), run on CPU tensors in the Triton interpreter
(TRITON_INTERPRET=1; on a CUDA machine the compiled kernels), against the CPU kernel and the fp64 oracle: odd head
counts and head_dims (tiles with masked heads and columns), empty parts, ``+inf`` LSEs, strided parts and
FlashInfer's ``[T, H]`` LSE as a view. The launchers are called directly; shapes are small."""

import os
import unittest

import torch

if not torch.cuda.is_available():  # before triton.jit decorates the kernels (tests/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvops.cpu import merge as cpu  # noqa: E402
from kvops.triton import merge as tri  # noqa: E402
from tests.cascade.test_merge import INF, TOL, parts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on(*ts):
    return [t.to(DEVICE) for t in ts]


class TestMergeTriton(unittest.TestCase):
    def test_two_parts(self):
        for (t, h_q, h_kv, d, length), dtype in (((5, 10, 2, 80, 21), torch.float32),
                                                 ((3, 7, 1, 64, 9), torch.bfloat16),
                                                 ((2, 3, 3, 24, 5), torch.float16)):
            with self.subTest(t=t, h=h_q, d=d, dtype=dtype):
                outs, lses, (want_out, want_lse) = parts(t, h_q, h_kv, d, length, 2, seed=d, empty_rows=(0,))
                lses = lses.float()
                lses[1, 0, 1] = INF  # FlashAttention-2's empty part
                args = (outs[0].to(dtype), lses[0], outs[1].to(dtype), lses[1])
                o, lse = tri.merge_attention_states(*on(*args))
                o_cpu, lse_cpu = cpu.merge_attention_states(*args)
                self.assertEqual(o.dtype, dtype)
                torch.testing.assert_close(o.cpu(), o_cpu, **TOL[dtype])
                torch.testing.assert_close(lse.cpu(), lse_cpu)
                self.assertFalse(bool(o.isnan().any()) or bool(lse.isnan().any()))
                self.assertEqual(o[0].abs().max().item(), 0.0)
                self.assertTrue(bool((lse[:, 0] == -INF).all()))

    def test_two_parts_strided_with_flashinfer_lse(self):
        outs, lses, (want_out, want_lse) = parts(4, 5, 1, 40, 13, 2, seed=5)
        buf = torch.randn(4, 6, 2, 40)
        buf[:, :5, 0], buf[:, :5, 1] = outs[0].float(), outs[1].float()
        t_h = [lse.t().contiguous().float() for lse in lses]
        o, lse = tri.merge_attention_states(*on(buf[:, :5, 0], t_h[0].t(), buf[:, :5, 1], t_h[1].t()))
        torch.testing.assert_close(o.cpu().double(), want_out, **TOL[torch.float32])
        torch.testing.assert_close(lse.cpu().double(), want_lse, atol=1e-5, rtol=1e-5)

    def test_many_parts(self):
        for n, dtype in ((1, torch.float32), (3, torch.bfloat16), (5, torch.float32)):
            with self.subTest(n=n, dtype=dtype):
                outs, lses, (want_out, want_lse) = parts(3, 6, 2, 48, 7, n, seed=n, empty_rows=(2,))
                o, lse = tri.merge_attention_states_many(*on(outs.to(dtype), lses.float()))
                torch.testing.assert_close(o.cpu().double(), want_out, **TOL[dtype])
                torch.testing.assert_close(lse.cpu().double(), want_lse, atol=1e-5, rtol=1e-5)
                self.assertEqual(o[2].abs().max().item(), 0.0)

    def test_no_rows(self):
        o, lse = tri.merge_attention_states_many(*on(torch.randn(2, 0, 4, 8), torch.randn(2, 4, 0)))
        self.assertEqual((tuple(o.shape), tuple(lse.shape)), ((0, 4, 8), (4, 0)))


if __name__ == "__main__":
    unittest.main()

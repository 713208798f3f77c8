"""ONNX export of the merge ops (lowering/onnx.py), run in onnxruntime's CPU provider against eager: empty parts
(``-inf``), FlashAttention-2's ``+inf``, both parts empty, and the many-way form (float32)."""

from __future__ import annotations

import unittest

import torch

import kvops
from tests.export.test_onnx import export_onnx, run_onnx

INF = float("inf")


class Merge(torch.nn.Module):
    def forward(self, o_a, lse_a, o_b, lse_b):
        return kvops.merge_attention_states(o_a, lse_a, o_b, lse_b)


class MergeMany(torch.nn.Module):
    def forward(self, outs, lses):
        return kvops.merge_attention_states_many(outs, lses)


class TestMergeOnnx(unittest.TestCase):
    def inputs(self, n, dtype):
        g = torch.Generator().manual_seed(n)
        outs = torch.randn(n, 5, 3, 16, generator=g)
        lses = torch.randn(n, 3, 5, generator=g)
        lses[0, 0, 1] = -INF
        lses[1, 2, 3] = INF
        lses[:, 1, 4] = -INF  # every part empty
        outs[0, 1, 0] = 0.0
        outs[:, 4, 1] = 0.0
        return outs.to(dtype), lses

    def test_two_parts(self):
        outs, lses = self.inputs(2, torch.float32)
        args = (outs[0], lses[0], outs[1], lses[1])
        session = export_onnx(Merge(), args)
        got = run_onnx(session, args)
        want = kvops.merge_attention_states(*args)
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)

    def test_many_parts(self):
        outs, lses = self.inputs(3, torch.float32)
        session = export_onnx(MergeMany(), (outs, lses))
        got = run_onnx(session, (outs, lses))
        want = kvops.merge_attention_states_many(outs, lses)
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)


if __name__ == "__main__":
    unittest.main()

"""Scalar arguments of a compiled function that change between calls: Dynamo's second call recompiles with the number
symbolic (automatic dynamic: a SymInt or SymFloat), and the ops' argument checks and messages must take it as they
take a plain number (the value in the message, not the symbol's name; no error about reading a traced number).
The scale tensors' own cases: tests/errors/test_float_scales.py."""

import expecttest
import torch

import kvops
from tests.contract import raises_for_each


def paged_inputs():
    q, kc, vc = torch.randn(1, 2, 8), torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8)
    return q, kc, vc, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)


class TestPagedAttention(expecttest.TestCase):
    def test_window_left(self):  # checked by the op's fake rule, which receives the SymInt
        q, kc, vc, cu, lens = paged_inputs()
        table = torch.zeros(1, 1, dtype=torch.int32)
        msg = "\n".join(raises_for_each(self, ValueError, lambda q, kc, vc, w: kvops.paged_attention(
            q, kc, vc, cu, lens, table, 1, window_left=w), (q, kc, vc), (-2, -3)))
        self.assertExpectedInline(msg, """\
kvops.paged_attention: window_left must be -1 (no window) or >= 0, got -2.
kvops.paged_attention: window_left must be -1 (no window) or >= 0, got -3.""")


class TestFlashAttnWithKVCache(expecttest.TestCase):
    def setUp(self):
        g = torch.Generator().manual_seed(0)
        self.q, self.kc, self.vc = (torch.randn(1, 2, 2, 8, generator=g), torch.randn(1, 6, 2, 8, generator=g),
                                    torch.randn(1, 6, 2, 8, generator=g))
        self.lens = torch.tensor([5], dtype=torch.int32)

    def test_softcap(self):  # checked by Python the compiled function traces (kvops/_checks/forms.py float_arg)
        msg = "\n".join(raises_for_each(self, ValueError, lambda q, kc, vc, c: kvops.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=self.lens, softcap=c), (self.q, self.kc, self.vc), (-1.0, -2.0),
            compile_exc=torch._dynamo.exc.Unsupported))
        self.assertExpectedInline(msg, """\
kvops.paged_attention: softcap must be >= 0 (0 disables it), got -1.0.
kvops.paged_attention: softcap must be >= 0 (0 disables it), got -2.0.""")

    def test_valid_floats_recompile(self):
        """softmax_scale and softcap that change between calls: each call as in eager (no error on the second)."""
        for name, values in (("softmax_scale", (0.5, 0.25, 0.125)), ("softcap", (1.0, 2.0, 3.0))):
            def attend(q, kc, vc, x, name=name):
                return kvops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=self.lens, **{name: x})

            torch._dynamo.reset()
            compiled = torch.compile(attend, fullgraph=True, backend="eager")
            for x in values:
                torch.testing.assert_close(compiled(self.q, self.kc, self.vc, x), attend(self.q, self.kc, self.vc, x),
                                           atol=0, rtol=0, msg=f"{name}={x}")


if __name__ == "__main__":
    import unittest

    unittest.main()

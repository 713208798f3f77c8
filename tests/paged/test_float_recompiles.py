"""A float argument of an op (``scale``, ``softcap``, ...) given as an argument of a compiled function that changes
between calls: the op's ``float`` argument is specialized (Dynamo guards on its value), so each distinct value compiles
one graph, whatever ``torch._dynamo.config.specialize_float`` says, and past ``recompile_limit`` distinct values
``fullgraph=True`` fails. docs/compile.md "Float arguments" documents it and its remedies, pinned here (the limit is
lowered to keep the tests short)."""

import unittest

import torch
import torch._dynamo.testing

import kvops

I32 = torch.int32


class TestFloatRecompiles(unittest.TestCase):
    def setUp(self):
        g = torch.Generator().manual_seed(0)
        self.q, self.kc, self.vc = (torch.randn(3, 4, 16, generator=g), torch.randn(3, 4, 2, 16, generator=g),
                                    torch.randn(3, 4, 2, 16, generator=g))
        self.cu, self.lens = torch.tensor([0, 2, 3], dtype=I32), torch.tensor([6, 7], dtype=I32)
        self.table = torch.tensor([[0, 1], [0, 2]], dtype=I32)
        torch._dynamo.reset()

    def attend(self, name):
        def attend(q, kc, vc, x):
            return kvops.paged_attention(q, kc, vc, self.cu, self.lens, self.table, 2, **{name: x})
        return attend

    def test_one_graph_per_value_and_the_limit(self):
        for name in ("scale", "softcap"):
            for specialize_float in (False, True):  # (False: torch's default) the same either way
                torch._dynamo.reset()
                counter = torch._dynamo.testing.CompileCounter()
                compiled = torch.compile(self.attend(name), fullgraph=True, backend=counter)
                with torch._dynamo.config.patch(recompile_limit=3, specialize_float=specialize_float):
                    for x in (0.5, 0.25, 2.0, 0.5):  # the fourth: a value seen before, no compile
                        compiled(self.q, self.kc, self.vc, x)
                    self.assertEqual(counter.frame_count, 3, (name, specialize_float))
                    with self.assertRaises(torch._dynamo.exc.FailOnRecompileLimitHit):
                        compiled(self.q, self.kc, self.vc, 4.0)

    def test_raised_limit(self):
        """``recompile_limit`` raised to the number of values: each compiles once, every result is eager's."""
        attend = self.attend("scale")
        counter = torch._dynamo.testing.CompileCounter()
        compiled = torch.compile(attend, fullgraph=True, backend=counter)
        values = [0.05 * (i + 1) for i in range(10)]
        with torch._dynamo.config.patch(recompile_limit=len(values)):
            for x in values + values[:3]:
                torch.testing.assert_close(compiled(self.q, self.kc, self.vc, x), attend(self.q, self.kc, self.vc, x),
                                           atol=0, rtol=0, msg=f"scale={x}")
        self.assertEqual(counter.frame_count, len(values))

    def test_without_fullgraph_calls_past_the_limit_run_eagerly(self):
        attend = self.attend("softcap")
        counter = torch._dynamo.testing.CompileCounter()
        compiled = torch.compile(attend, backend=counter)
        with torch._dynamo.config.patch(recompile_limit=2):
            for x in (1.0, 2.0, 3.0, 4.0):
                torch.testing.assert_close(compiled(self.q, self.kc, self.vc, x), attend(self.q, self.kc, self.vc, x),
                                           atol=0, rtol=0, msg=f"softcap={x}")
        self.assertEqual(counter.frame_count, 2)

    def test_scale_folded_into_q(self):
        """The softmax scale as a 0-d tensor multiplying q (``scale=1.0``): one graph for every value."""
        def attend(q, kc, vc, s):
            return kvops.paged_attention(q * s, kc, vc, self.cu, self.lens, self.table, 2, scale=1.0)

        counter = torch._dynamo.testing.CompileCounter()
        compiled = torch.compile(attend, fullgraph=True, backend=counter)
        for i in range(10):
            s = torch.tensor(0.05 * (i + 1))
            out = compiled(self.q, self.kc, self.vc, s)
            torch.testing.assert_close(out, attend(self.q, self.kc, self.vc, s), atol=0, rtol=0)
            torch.testing.assert_close(out, self.attend("scale")(self.q, self.kc, self.vc, 0.05 * (i + 1)))
        self.assertEqual(counter.frame_count, 1)


if __name__ == "__main__":
    unittest.main()

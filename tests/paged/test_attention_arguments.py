"""Argument combinations of ``kvops.paged_attention`` / ``kvops.flash_attn_with_kvcache`` that a new user may pass
(docs/attention_features.md, "Argument combinations"): each either raises a clear error (eager, compile, export;
nothing written) or has a documented meaning shown here against the plain reference.

* ``window_size`` not a pair: ``ValueError`` (FlashAttention indexes ``window_size[0]``/``[1]``: a 1-tuple is an
  ``IndexError`` there, a 3-tuple silently drops its last entry).
* ``cache_leftpad`` past ``seq_lens`` (``paged_attention``) or past ``cache_seqlens`` (``flash_attn_with_kvcache``,
  whose new tokens go to row ``cache_seqlens``): a value contract, ``RuntimeError`` per the value-check mode.
* ``window_right`` with ``causal=True``: the causal bound wins (FlashAttention's ``flash_api.cpp`` sets
  ``window_size_right = 0`` when ``is_causal``).
* ``sink_tokens`` without a window: no effect (every key is visible already).
"""

from __future__ import annotations

import unittest

import expecttest
import torch

import kvops
from kvops._checks.features import AttnFeatures
from kvops.cpu.paged_attention import paged_attention as composite
from kvops.reference.attention import reference
from tests.contract import _Wrap, raises_everywhere
from tests.paged.test_attention_features import make_case

PY_ERROR = torch._dynamo.exc.Unsupported


class TestWindowSize(expecttest.TestCase):
    def test_window_size_must_be_a_pair(self):
        f = kvops.flash_attn_with_kvcache
        q, kc, vc, k = torch.randn(2, 1, 4, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16), torch.randn(
            2, 1, 2, 16)
        before = kc.clone()
        msgs = []
        for window in [(3,), (3, 0, 1)]:
            msgs.append(raises_everywhere(
                self, ValueError, lambda q, kc, vc, k: f(q, kc, vc, k, k, cache_seqlens=1, window_size=window),
                (q, kc, vc, k), compile_exc=PY_ERROR))
            self.assertTrue(torch.equal(kc, before))  # nothing written
        self.assertExpectedInline(msgs[0], """flash_attn_with_kvcache: window_size must be a pair (left, right), each -1 (unbounded) or >= 0, given as a tuple or list of two ints or a 2-element integer tensor, as FlashAttention accepts; got (3,). Pass e.g. (-1, -1) for no window or (left, 0) for a causal sliding window.""")
        self.assertExpectedInline(msgs[1], """flash_attn_with_kvcache: window_size must be a pair (left, right), each -1 (unbounded) or >= 0, given as a tuple or list of two ints or a 2-element integer tensor, as FlashAttention accepts; got (3, 0, 1). Pass e.g. (-1, -1) for no window or (left, 0) for a causal sliding window.""")


class TestLeftpadPastTheKeys(expecttest.TestCase):
    def setUp(self):
        self.q, self.kc, self.vc, self.cu, self.lens, self.table = make_case(0, h_q=4, h_kv=2, d=16)  # lens 70 40 53

    def attend(self, q, kc, vc, cu, lens, table, pad):
        return kvops.paged_attention(q, kc, vc, cu, lens, table, 7, cache_leftpad=pad)

    def test_paged_attention(self):
        args = (self.q, self.kc, self.vc, self.cu, self.lens, self.table)
        ok = torch.tensor([0, 40, 3], dtype=torch.int32)  # cache_leftpad == seq_len: no key (out 0)
        out = self.attend(*args, ok)
        self.assertTrue(torch.equal(out[1:8], torch.zeros_like(out[1:8])))
        bad = torch.tensor([0, 41, 3], dtype=torch.int32)
        with self.assertRaises(RuntimeError) as cm:
            self.attend(*args, bad)
        self.assertExpectedInline(str(cm.exception), """\
kvops.paged_attention: cache_leftpad[1] = 41 is past seq_lens[1] = 40; it is the first KV row of sequence 1 and must be in [0, seq_len] (sequence 1's keys are rows [cache_leftpad, seq_len)).""")
        with kvops.value_checks("async"):
            with self.assertRaisesRegex(RuntimeError, r"cache_leftpad holds a row outside \[0, seq_len\]"):
                self.attend(*args, bad)
            torch._dynamo.reset()
            compiled = torch.compile(self.attend, fullgraph=True, backend="aot_eager")
            torch.testing.assert_close(compiled(*args, ok), out)
            with self.assertRaisesRegex(RuntimeError, r"cache_leftpad holds a row outside \[0, seq_len\]"):
                compiled(*args, bad)
            ep = torch.export.export(_Wrap(self.attend), (*args, ok))
        with self.assertRaisesRegex(RuntimeError, r"cache_leftpad holds a row outside \[0, seq_len\]"):
            ep.module()(*args, bad)

    def test_flash_attn_with_kvcache(self):
        q, kc, vc = torch.randn(2, 2, 4, 16), torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)
        k = torch.randn(2, 2, 2, 16)
        table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
        lens = torch.tensor([3, 5], dtype=torch.int32)

        def call(q, kc, vc, k, lens, pad):
            return kvops.flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=lens, cache_leftpad=pad,
                                                 block_table=table, causal=True)

        before = (kc.clone(), vc.clone())
        bad = torch.tensor([0, 6], dtype=torch.int32)  # past cache_seqlens 5 (though within 5 + 2 new tokens)
        with self.assertRaises(RuntimeError) as cm:
            call(q, kc, vc, k, lens, bad)
        self.assertExpectedInline(str(cm.exception), """\
flash_attn_with_kvcache: cache_leftpad[1] = 6 is outside [0, cache_seqlens[1] = 5]: it is the first key row of sequence 1, and the new tokens are written at row cache_seqlens[1]. Nothing was written. Pass 0 <= cache_leftpad <= cache_seqlens.""")
        self.assertTrue(torch.equal(kc, before[0]) and torch.equal(vc, before[1]))
        self.assertRaisesRegex(RuntimeError, r"cache_leftpad\[0\] = -1 is outside", call, q, kc, vc, k, lens,
                               torch.tensor([-1, 0], dtype=torch.int32))
        self.assertTrue(torch.equal(kc, before[0]))
        with kvops.value_checks("async"):
            torch._dynamo.reset()
            compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
            with self.assertRaisesRegex(RuntimeError, r"cache_leftpad holds a row outside \[0, cache_seqlens\]"):
                compiled(q, kc, vc, k, lens, bad)
            self.assertTrue(torch.equal(kc, before[0]) and torch.equal(vc, before[1]))
            ep = torch.export.export(_Wrap(call), (q, kc.clone(), vc.clone(), k, lens, torch.zeros(2, dtype=torch.int32)))
        kc2, vc2 = kc.clone(), vc.clone()
        with self.assertRaisesRegex(RuntimeError, r"cache_leftpad holds a row outside \[0, cache_seqlens\]"):
            ep.module()(q, kc2, vc2, k, lens, bad)
        self.assertTrue(torch.equal(kc2, before[0]) and torch.equal(vc2, before[1]))
        call(q, kc, vc, k, lens, torch.tensor([3, 5], dtype=torch.int32))  # == cache_seqlens: the new tokens only


class TestDocumentedCombinations(unittest.TestCase):
    def kernels(self, q, kc, vc, cu, lens, table, **kw):
        """The native kernel's and the composite's outputs for ``kw``."""
        native = kvops.paged_attention(q, kc, vc, cu, lens, table, 7, **kw)
        causal, left = kw.pop("causal", True), kw.pop("window_left", -1)
        comp, _ = composite(q, kc, vc, cu, lens, table, 7, q.shape[2] ** -0.5, causal, left, 0.0, None, None, None,
                            AttnFeatures(**kw))
        return native, comp

    def test_window_right_with_causal_is_causal(self):
        q, kc, vc, cu, lens, table = make_case(1, h_q=4, h_kv=2, d=16)
        want, _ = reference(q, kc, vc, cu, lens, table, causal=True, window_left=9)
        for right in (0, 3, 100):
            for out in self.kernels(q, kc, vc, cu, lens, table, causal=True, window_left=9, window_right=right):
                torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)
        # flash_attn_with_kvcache: causal=True with window_size=(9, 3) is (9, 0), as FlashAttention
        qd, kd, vd = torch.randn(2, 3, 4, 16), torch.randn(2, 32, 2, 16), torch.randn(2, 32, 2, 16)
        a = kvops.flash_attn_with_kvcache(qd, kd, vd, cache_seqlens=20, causal=True, window_size=(9, 3))
        b = kvops.flash_attn_with_kvcache(qd, kd, vd, cache_seqlens=20, causal=True, window_size=(9, 0))
        self.assertTrue(torch.equal(a, b))

    def test_sink_tokens_without_window_change_nothing(self):
        q, kc, vc, cu, lens, table = make_case(2, h_q=4, h_kv=2, d=16)
        for kw in (dict(), dict(rope_theta=1e4), dict(causal=False)):
            want, _ = reference(q, kc, vc, cu, lens, table, **kw)
            for out in self.kernels(q, kc, vc, cu, lens, table, sink_tokens=4, **kw):
                torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)


if __name__ == "__main__":
    unittest.main()

"""``kvops.flash_attn_with_kvcache`` takes every argument form FlashAttention's ``flash_attn_with_kvcache`` takes, with
its meaning (kvops/_checks/forms.py, docs/porting.md "FlashAttention's argument forms"), and refuses the rest before
anything is written; ``cache_batch_idx`` selects the k_cache row of each sequence, as FlashAttention's.

FlashAttention's own ``test_flash_attn_kvcache`` passes ``window_size = torch.randint(0, seqlen_k, (2,))``; its
pybind11 entry point converts ``window_size[i]``, ``softmax_scale``, ``softcap``, ``causal`` and ``num_splits``, so a
NumPy integer, a one-element tensor or an int where a float goes are all accepted there.
"""

from __future__ import annotations

import unittest

import expecttest
import numpy as np
import torch

import kvops
from tests.contract import raises_everywhere
from tests.integrations.test_flash_attn_api import ref_flash

PY_ERROR = torch._dynamo.exc.Unsupported  # raised by the composite's Python checks under fullgraph=True
f = kvops.flash_attn_with_kvcache


def case(seed=0, batch=2, s_q=2, cache_rows=12, h_q=4, h_kv=2, d=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, s_q, h_q, d, generator=g)
    kc = torch.randn(batch, cache_rows, h_kv, d, generator=g)
    vc = torch.randn(batch, cache_rows, h_kv, d, generator=g)
    k = torch.randn(batch, s_q, h_kv, d, generator=g)
    v = torch.randn(batch, s_q, h_kv, d, generator=g)
    lens = torch.tensor([3, 7][:batch], dtype=torch.int32)
    return q, kc, vc, k, v, lens


class TestAcceptedForms(unittest.TestCase):
    def run_forms(self, canonical: dict, forms: list[dict], causal=False):
        q, kc, vc, k, v, lens = case()
        base = (kc.clone(), vc.clone())
        want = f(q, base[0], base[1], k, v, **{"cache_seqlens": lens, "causal": causal, **canonical})
        for kw in forms:
            caches = (kc.clone(), vc.clone())
            got = f(q, caches[0], caches[1], k, v, **{"cache_seqlens": lens, "causal": causal, **kw})
            self.assertTrue(torch.equal(got, want), kw)
            self.assertTrue(torch.equal(caches[0], base[0]) and torch.equal(caches[1], base[1]), kw)
        return want

    def test_window_size_forms(self):
        for causal in (False, True):
            window = torch.tensor([3, 2])  # FlashAttention's test: torch.randint(0, seqlen_k, (2,)), int64 on the CPU
            want = self.run_forms(dict(window_size=(3, 2)), [
                dict(window_size=window), dict(window_size=window.to(torch.int32)), dict(window_size=[3, 2]),
                dict(window_size=tuple(window)), dict(window_size=(np.int64(3), np.int32(2))),
                dict(window_size=(torch.tensor([3]), 2)),
            ], causal=causal)
            # and the window means FlashAttention's: keys [pos - 3, pos + 2] (right 0 when causal)
            q, kc, vc, k, v, lens = case()
            ref, _, _, _ = ref_flash(q, kc, vc, k, v, lens, None, 16 ** -0.5, causal, (3, 2), 0.0)
            torch.testing.assert_close(want.double(), ref, atol=2e-5, rtol=2e-5)

    def test_scalar_forms(self):
        self.run_forms(dict(softmax_scale=0.5),
                       [dict(softmax_scale=torch.tensor(0.5)), dict(softmax_scale=np.float32(0.5))])
        self.run_forms(dict(softmax_scale=2.0), [dict(softmax_scale=2), dict(softmax_scale=torch.tensor([2.0]))])
        self.run_forms(dict(softcap=5.0),
                       [dict(softcap=5), dict(softcap=torch.tensor(5.0)), dict(softcap=np.float64(5))])
        self.run_forms(dict(causal=True),
                       [dict(causal=1), dict(causal=np.bool_(True)), dict(causal=torch.tensor(True))])
        self.run_forms(dict(num_splits=0), [dict(num_splits=1), dict(num_splits=np.int64(4)), dict(num_splits=True)])
        self.run_forms(dict(cache_seqlens=5), [dict(cache_seqlens=np.int64(5))])
        out, lse = f(*case()[:5], cache_seqlens=case()[5], return_softmax_lse=1)
        self.assertEqual(lse.shape, (2, 4, 2))

    def test_rotary_interleaved_forms(self):
        q, kc, vc, k, v, lens = case()
        cos, sin = torch.rand(12, 4).cos(), torch.rand(12, 4).sin()
        want = f(q, kc.clone(), vc.clone(), k, v, cos, sin, lens, rotary_interleaved=False)
        for form in (0, np.bool_(False), torch.tensor(False)):
            got = f(q, kc.clone(), vc.clone(), k, v, cos, sin, lens, rotary_interleaved=form)
            self.assertTrue(torch.equal(got, want))

    def test_compile_without_fullgraph_refuses_a_tensor_window_too(self):
        """Dynamo folds the traced branch into the code it runs, so without ``fullgraph`` the refusal is raised as
        well (a plain ``ValueError``): pass the window as ints when compiling."""
        q, kc, vc, k, v, lens = case()
        torch._dynamo.reset()
        with self.assertRaisesRegex(ValueError, r"window_size was given as a tensor while compiling"):
            torch.compile(f, backend="eager")(q, kc, vc, k, v, cache_seqlens=lens, window_size=torch.tensor([3, 2]))


class TestCacheBatchIdx(expecttest.TestCase):
    def test_selects_the_cache_rows(self):
        q, _, _, k, v, lens = case()
        g = torch.Generator().manual_seed(3)
        kc, vc = torch.randn(5, 12, 2, 16, generator=g), torch.randn(5, 12, 2, 16, generator=g)
        idx = torch.tensor([3, 1], dtype=torch.int32)
        for causal, window in ((True, (-1, -1)), (False, (4, 1))):
            k_cache, v_cache = kc.clone(), vc.clone()
            out, lse = f(q, k_cache, v_cache, k, v, cache_seqlens=lens, cache_batch_idx=idx, causal=causal,
                         window_size=window, return_softmax_lse=True)
            ref, ref_lse, ref_k, ref_v = ref_flash(q, kc[idx.long()], vc[idx.long()], k, v, lens, None, 16 ** -0.5,
                                                   causal, window, 0.0)
            torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
            self.assertTrue(torch.equal(k_cache[idx.long()], ref_k) and torch.equal(v_cache[idx.long()], ref_v))
            others = [0, 2, 4]  # rows no sequence uses are untouched
            self.assertTrue(torch.equal(k_cache[others], kc[others]) and torch.equal(v_cache[others], vc[others]))

    def test_value_contract(self):
        q, _, _, k, v, lens = case()
        kc, vc = torch.zeros(3, 12, 2, 16), torch.zeros(3, 12, 2, 16)
        bad = torch.tensor([0, 3], dtype=torch.int32)
        with self.assertRaises(RuntimeError) as cm:
            f(q, kc, vc, k, v, cache_seqlens=lens, cache_batch_idx=bad)
        self.assertExpectedInline(str(cm.exception), """flash_attn_with_kvcache: cache_batch_idx[1] = 3 is outside [0, 3), the rows of k_cache [batch_size_cache, seqlen_cache, num_kv_heads, head_dim]. Nothing was written. Pass the k_cache row of each sequence.""")
        with kvops.value_checks("async"):
            with self.assertRaisesRegex(RuntimeError, r"cache_batch_idx holds a row outside \[0, batch_size_cache"):
                f(q, kc, vc, k, v, cache_seqlens=lens, cache_batch_idx=bad)
        with kvops.value_checks("off"):  # unchecked: a row outside k_cache is never written; the CPU attention
            with self.assertRaisesRegex(RuntimeError, r"block_table\[0, 0\] = -7 is not a block"):  # refuses it
                f(q, kc, vc, k, v, cache_seqlens=lens, cache_batch_idx=torch.tensor([-7, 9], dtype=torch.int32))
        self.assertFalse(kc.any() or vc.any())


class TestRefusedForms(expecttest.TestCase):
    def setUp(self):
        self.q, self.kc, self.vc, self.k, self.v, self.lens = case()
        self.before = (self.kc.clone(), self.vc.clone())

    def check(self, modes=("eager", "compile", "export"), **kw):
        msg = raises_everywhere(
            self, ValueError, lambda q, kc, vc, k, v, lens: f(q, kc, vc, k, v, **{"cache_seqlens": lens, **kw}),
            (self.q, self.kc, self.vc, self.k, self.v, self.lens), modes=modes, compile_exc=PY_ERROR)
        self.assertTrue(torch.equal(self.kc, self.before[0]) and torch.equal(self.vc, self.before[1]))  # unwritten
        return msg

    def test_window_size(self):
        self.assertExpectedInline(self.check(window_size=(2.5, 0)), """flash_attn_with_kvcache: window_size must be a pair (left, right), each -1 (unbounded) or >= 0, given as a tuple or list of two ints or a 2-element integer tensor, as FlashAttention accepts; got (2.5, 0). Pass e.g. (-1, -1) for no window or (left, 0) for a causal sliding window.""")
        self.assertExpectedInline(self.check(window_size=torch.tensor([2.5, 0.0])), """flash_attn_with_kvcache: window_size must be a pair (left, right), each -1 (unbounded) or >= 0, given as a tuple or list of two ints or a 2-element integer tensor, as FlashAttention accepts; got a tensor of shape (2,) and dtype torch.float32. Pass e.g. (-1, -1) for no window or (left, 0) for a causal sliding window.""")
        self.assertExpectedInline(self.check(window_size=torch.tensor([1, 2, 3])), """flash_attn_with_kvcache: window_size must be a pair (left, right), each -1 (unbounded) or >= 0, given as a tuple or list of two ints or a 2-element integer tensor, as FlashAttention accepts; got a tensor of shape (3,) and dtype torch.int64. Pass e.g. (-1, -1) for no window or (left, 0) for a causal sliding window.""")
        self.assertExpectedInline(self.check(window_size=None), """flash_attn_with_kvcache: window_size must be a pair (left, right), each -1 (unbounded) or >= 0, given as a tuple or list of two ints or a 2-element integer tensor, as FlashAttention accepts; got None. Pass e.g. (-1, -1) for no window or (left, 0) for a causal sliding window.""")

    def test_scalars(self):
        self.assertExpectedInline(self.check(softmax_scale="0.5"), """flash_attn_with_kvcache: softmax_scale must be a float or None (an int, a float or a one-element tensor, as FlashAttention accepts), got str '0.5'.""")
        self.assertExpectedInline(self.check(softcap=None), """flash_attn_with_kvcache: softcap must be a float (an int, a float or a one-element tensor, as FlashAttention accepts), got NoneType None.""")
        self.assertExpectedInline(self.check(softcap=torch.ones(2)), """flash_attn_with_kvcache: softcap must be a float; a tensor softcap must hold one real element, got a tensor of shape (2,) and dtype torch.float32.""")
        self.assertExpectedInline(self.check(num_splits=1.5), """flash_attn_with_kvcache: num_splits must be an int, got float 1.5. Pass a whole number (int(num_splits) if it is integral).""")
        self.assertExpectedInline(self.check(causal=torch.ones(2, dtype=torch.bool)), """flash_attn_with_kvcache: causal must be a bool; a tensor causal must hold one element, got shape (2,).""")
        self.assertExpectedInline(self.check(num_splits=torch.zeros(2, dtype=torch.int64)), """flash_attn_with_kvcache: num_splits must be an int; a tensor num_splits must hold one integer element, got a tensor of shape (2,) and dtype torch.int64.""")
        self.assertExpectedInline(self.check(cache_seqlens=1.5), """flash_attn_with_kvcache: cache_seqlens must be an int or an int32 tensor of shape [batch], got float 1.5. Pass a whole number (int(cache_seqlens) if it is integral).""")
        self.assertExpectedInline(self.check(cache_batch_idx=torch.zeros(2)), """flash_attn_with_kvcache: cache_batch_idx must be an int32 tensor of shape [2] (the k_cache row of each sequence), got shape (2,) and dtype torch.float32. Pass cache_batch_idx.to(torch.int32) (built with integer ops: // rather than /).""")

    def test_a_tensor_where_a_python_value_is_traced(self):
        """Eager calls read these tensors (as FlashAttention); traced calls refuse them, naming the form that
        compiles (an eager call with the same arguments is valid, so only compile and export are checked)."""
        traced = ("compile", "export")
        self.assertExpectedInline(self.check(traced, window_size=torch.tensor([3, 2])), """flash_attn_with_kvcache: window_size was given as a tensor while compiling or exporting; its value is needed as a Python tuple of two ints when the call is traced, and reading a tensor there would bake one value into the graph. Pass window_size as a tuple of two ints (e.g. window_size=tuple(window_size.tolist()) outside the compiled function); a tensor window_size is read once in eager calls only.""")
        self.assertExpectedInline(self.check(traced, window_size=(torch.tensor(3), 2)), """flash_attn_with_kvcache: window_size was given as a tensor while compiling or exporting; its value is needed as a Python tuple of two ints when the call is traced, and reading a tensor there would bake one value into the graph. Pass window_size as a tuple of two ints (e.g. window_size=(int(left), int(right)) outside the compiled function); a tensor window_size is read once in eager calls only.""")
        self.assertExpectedInline(self.check(traced, softmax_scale=torch.tensor(0.5)), """flash_attn_with_kvcache: softmax_scale was given as a tensor while compiling or exporting; its value is needed as a Python float when the call is traced, and reading a tensor there would bake one value into the graph. Pass softmax_scale as a float (e.g. softmax_scale=float(softmax_scale) outside the compiled function); a tensor softmax_scale is read once in eager calls only.""")


if __name__ == "__main__":
    unittest.main()

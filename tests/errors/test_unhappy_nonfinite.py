"""Non-finite scalars and data in attention.

* ``scale`` NaN/inf, ``softcap`` inf/NaN (NaN passed the ">= 0" check), ``rope_theta``/``rope_scale`` inf are refused
  at the contract (``ValueError`` naming the argument, the value and the fix; eager, compile and export).
* NaN or infinite ALiBi slopes (tensor contents) are refused under the value-check modes (eager: ``RuntimeError``
  naming ``alibi_slopes[h]``; async: an assert, and ``flash_attn_with_kvcache`` writes nothing); unchecked (``"off"``)
  the kernels give NaN rows, never the 0 / ``-inf`` of a query with no keys.
* A NaN in a *visible* key (or in q) gives a NaN output and LSE, as SDPA, in the native, composite and Triton
  kernels (decode, split-KV decode, prefill); NaN/inf in slots beyond ``seq_len``, in blocks the table does not
  reference and in keys a query's mask hides never reach its output (docs/semantics.md §4).
"""

from __future__ import annotations

import math
import os
import unittest

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import expecttest  # noqa: E402

import kvops  # noqa: E402
from kvops._checks.features import AttnFeatures  # noqa: E402
from kvops.cpu.paged_attention import paged_attention as composite  # noqa: E402
from kvops.triton.paged_attention import paged_attention as triton_pa  # noqa: E402
from tests.contract import raises_everywhere  # noqa: E402
from tests.paged.test_paged_attention import make_inputs  # noqa: E402
from tests.unhappy import check_failing_call  # noqa: E402

I32 = torch.int32
NAN, INF = float("nan"), float("inf")


def inputs(seed=0):
    """Two sequences (KV 9 and 21, q_len 1 and 3), block_size 4, GQA 2:1, head_dim 16; NaN in every unused slot."""
    return make_inputs(seed, [9, 21], [1, 3], block_size=4, h_q=4, h_kv=2, d=16)


def args_of(x):
    return x["q"], x["k_cache"], x["v_cache"], x["cu_seqlens_q"], x["seq_lens"], x["block_table"], x["max_seqlen_q"]


def set_key(x, b, j, head=0, value=NAN, which="k_cache"):
    """Key/value position ``j`` of sequence ``b`` (through the table) set to ``value`` in KV head ``head``."""
    bs = x["k_cache"].shape[1]
    x[which][int(x["block_table"][b, j // bs]), j % bs, head, 0] = value


def kernels():
    """``name -> run(x, **kw) -> (out, lse)`` for every CPU-reachable kernel (Triton in the interpreter)."""
    def op(x, **kw):
        return kvops.paged_attention(*args_of(x), return_lse=True, **kw)

    def plain(x, fn, **kw):
        scale = kw.pop("scale", 16 ** -0.5)
        feats = AttnFeatures(**{k: kw.pop(k) for k in AttnFeatures._fields if k in kw})
        return fn(*args_of(x), scale, kw.pop("causal", True), kw.pop("window_left", -1), kw.pop("softcap", 0.0),
                  kw.pop("sinks", None), None, None, feats, **kw)

    return {
        "native": op,
        "composite": lambda x, **kw: plain(x, composite, **kw),
        "triton prefill": lambda x, **kw: plain(x, triton_pa, force_prefill=True, **kw),
        "triton decode (split)": lambda x, **kw: plain({**x, "max_seqlen_q": 1, "cu_seqlens_q": torch.tensor(
            [0, 1, 2], dtype=I32), "q": x["q"][:2]}, triton_pa, num_splits=3, **kw),
    }


class TestNonFiniteScalars(expecttest.TestCase):
    def call(self, **kw):
        x = inputs()
        return lambda q: kvops.paged_attention(q, *args_of(x)[1:], **kw)

    def test_scale_softcap_rope(self):
        q = inputs()["q"]
        cases = [(dict(scale=NAN), "scale", "nan"), (dict(scale=INF), "scale", "inf"),
                 (dict(scale=-INF), "scale", "-inf"), (dict(softcap=INF), "softcap", "inf"),
                 (dict(softcap=NAN), "softcap", "nan"), (dict(rope_theta=INF), "rope_theta", "inf"),
                 (dict(rope_theta=1e4, rope_scale=INF), "rope_scale", "inf")]
        for kw, name, value in cases:
            with self.subTest(name, value=value):
                msg = raises_everywhere(self, ValueError, self.call(**kw), (q,))
                self.assertIn(f"{name} must be a finite number", msg)
                self.assertIn(f"got {value}.", msg)
        msg = raises_everywhere(self, ValueError, self.call(scale=NAN), (q,))
        self.assertExpectedInline(msg, """kvops.paged_attention: scale must be a finite number (the softmax scale on q·k; None: head_dim ** -0.5), got nan. Pass a finite scale, or None for the default.""")  # noqa: B950
        msg = raises_everywhere(self, ValueError, self.call(softcap=NAN), (q,))
        self.assertExpectedInline(msg, """kvops.paged_attention: softcap must be a finite number (scores become softcap * tanh(score / softcap); 0 disables it), got nan. Pass a finite softcap >= 0 (e.g. Gemma-2's 50.0), or 0.0 for none.""")  # noqa: B950

    def test_flash_attn_refuses_before_appending(self):
        kc, vc = torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8)
        k, v = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
        table, lens = torch.tensor([[0, 1], [2, 3]], dtype=I32), torch.tensor([2, 3], dtype=I32)
        for kw, needles in ((dict(softmax_scale=NAN), ["scale", "nan"]), (dict(softcap=INF), ["softcap", "inf"])):
            with self.subTest(**kw):
                check_failing_call(self, lambda: kvops.flash_attn_with_kvcache(
                    torch.randn(2, 1, 4, 8), kc, vc, k, v, cache_seqlens=lens, block_table=table, **kw), ValueError,
                    needles, state=(kc, vc))


class TestAlibiSlopes(expecttest.TestCase):
    def test_value_check_modes(self):
        x = inputs()
        for bad in (NAN, INF, -INF):
            slopes = torch.tensor([0.1, 0.2, bad, 0.4])
            with self.subTest(bad=bad):
                msg = check_failing_call(self, lambda: kvops.paged_attention(*args_of(x), alibi_slopes=slopes),
                                         RuntimeError, ["alibi_slopes[2]", str(bad)])
        self.assertExpectedInline(msg, """kvops.paged_attention: alibi_slopes[2] = -inf is not finite; ALiBi adds -slope * |pos - j| to every score of its head, so every score would be NaN or infinite. Pass finite slopes (e.g. 2 ** (-8 h / H_q), FlashAttention's and FlashInfer's).""")  # noqa: B950
        per_seq = torch.full((2, 4), 0.25)
        per_seq[1, 3] = NAN
        with self.assertRaisesRegex(RuntimeError, r"alibi_slopes\[1, 3\] = nan"):
            kvops.paged_attention(*args_of(x), alibi_slopes=per_seq)
        with kvops.value_checks("async"), self.assertRaisesRegex(RuntimeError, "alibi_slopes holds a NaN"):
            kvops.paged_attention(*args_of(x), alibi_slopes=torch.tensor([0.1, NAN, 0.3, 0.4]))

    def test_flash_attn_writes_nothing(self):
        kc, vc = torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8)
        k, v = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
        table, lens = torch.tensor([[0, 1], [2, 3]], dtype=I32), torch.tensor([2, 3], dtype=I32)
        slopes = torch.tensor([0.1, NAN, 0.3, 0.4])
        for mode in ("eager", "async"):
            with self.subTest(mode), kvops.value_checks(mode):
                check_failing_call(self, lambda: kvops.flash_attn_with_kvcache(
                    torch.randn(2, 1, 4, 8), kc, vc, k, v, cache_seqlens=lens, block_table=table,
                    alibi_slopes=slopes), RuntimeError, ["alibi_slopes"], state=(kc, vc))

    def test_unchecked_slopes_give_nan_rows(self):
        x = inputs()
        for name, run in kernels().items():
            for bad in (NAN, INF):
                with self.subTest(name, bad=bad), kvops.value_checks("off"):
                    out, lse = run(x, alibi_slopes=torch.tensor([0.1, 0.2, bad, 0.4]))
                    self.assertTrue(out[:, 2].isnan().all() and lse[2].isnan().all(), (out[:, 2], lse[2]))
                    self.assertTrue(torch.isfinite(out[:, [0, 1, 3]]).all())  # the other heads are untouched


class TestNonFiniteData(unittest.TestCase):
    def test_nan_in_a_visible_key_is_nan(self):
        """Sequence 1's key at position 2 (KV head 1) NaN: every query of sequence 1 sees it (causal: positions 18-20),
        so query heads 2-3 of sequence 1 are NaN, output and LSE; sequence 0 and KV head 0 stay finite."""
        for name, run in kernels().items():
            x = inputs()
            set_key(x, 1, 2, head=1)
            with self.subTest(name):
                out, lse = run(x)
                rows = slice(1, 4) if out.shape[0] == 4 else slice(1, 2)
                self.assertTrue(out[rows, 2:].isnan().all() and lse[2:, rows].isnan().all(), (out, lse))
                self.assertTrue(torch.isfinite(out[rows, :2]).all() and torch.isfinite(out[0]).all())

    def test_nan_query_is_nan(self):
        for name, run in kernels().items():
            x = inputs()
            x["q"][1, 0, 3] = NAN
            with self.subTest(name):
                out, lse = run(x)
                self.assertTrue(out[1, 0].isnan().all() and lse[0, 1].isnan(), (out[1], lse[:, 1]))
                self.assertTrue(torch.isfinite(out[0]).all())

    def test_single_visible_nan_key_with_window_and_sinks(self):
        """The only visible key NaN (window 0: each query sees itself): NaN, not the 0 / -inf of "no keys"; with
        sinks (gpt-oss) too."""
        for name, run in kernels().items():
            for sinks in (None, torch.tensor([0.5, -1.0, 0.0, 2.0])):
                x = inputs()
                set_key(x, 1, 20, head=0)
                with self.subTest(name, sinks=sinks is not None):
                    out, lse = run(x, window_left=0, sinks=sinks)
                    last = out.shape[0] - 1
                    self.assertTrue(out[last, :2].isnan().all() and lse[:2, last].isnan().all(), (out, lse))
                    self.assertTrue(torch.isfinite(out[last, 2:]).all())

    def test_native_split_kv_merge_keeps_the_nan(self):
        """A long decode on 2 threads runs split-KV (parts merged afterwards): a NaN in one part is NaN after the
        merge (a max over the parts' maxima may drop it)."""
        x = make_inputs(1, [5000], [1], block_size=16, h_q=2, h_kv=1, d=16)
        set_key(x, 0, 1234)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            out, lse = kvops.paged_attention(*args_of(x), return_lse=True)
            clean = kvops.paged_attention(*args_of(make_inputs(1, [5000], [1], block_size=16, h_q=2, h_kv=1, d=16)))
        finally:
            torch.set_num_threads(threads)
        self.assertTrue(out.isnan().all() and lse.isnan().all(), (out, lse))
        self.assertTrue(torch.isfinite(clean).all())

    def test_hidden_garbage_never_reaches_the_output(self):
        """NaN/inf beyond seq_len (make_inputs fills every unused slot and block with NaN), inf there too, and a NaN
        key the causal mask or the window hides: finite outputs equal to those without them."""
        for name, run in kernels().items():
            x = inputs()
            clean = run(x, window_left=2)
            for value in (NAN, INF, -INF):
                y = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
                y["k_cache"][torch.isnan(y["k_cache"])] = value
                set_key(y, 1, 20, head=1, value=value)  # sequence 1's last key: after query 0 (pos 18) and 1 (19)
                set_key(y, 1, 10, head=0, value=value)  # outside every window of sequence 1 (queries 18-20, w 2)
                with self.subTest(name, value=value):
                    out, _ = run(y, window_left=2)
                    n = out.shape[0]
                    hidden = [0, 1, 2] if n == 4 else [0]  # rows that cannot see position 20 (or nothing NaN)
                    self.assertTrue(torch.equal(out[hidden], clean[0][hidden]), (name, out[hidden]))


class TestPackedAttention(unittest.TestCase):
    """``packed_attention`` over a dense or quantized segment holding a NaN (a quantized NaN dequantizes to NaN:
    docs/semantics.md §2.0): NaN for the query heads that read it, in the native, composite and Triton kernels;
    a row ``row_counts`` hides (0) never reaches the output."""

    def test_every_kernel_and_format(self):
        import kvops.packed as kp
        from kvops.cpu import packed as pref
        from kvops.triton import packed_attention as triton_attention

        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 4, 16, generator=g)
        k, v = torch.randn(1, 16, 2, 16, generator=g), torch.randn(1, 16, 2, 16, generator=g)
        k[0, 3, 1, 2] = NAN  # KV head 1: query heads 2, 3
        kernels = {"native": lambda *a: torch.ops.kvops.packed_attention(*a),
                   "composite": pref.packed_attention, "triton": triton_attention.packed_attention}
        for quant in (None, *kp.FORMATS):
            if quant is None:
                args = (q, [k], [v], [], [], None, 0.25)
            else:
                args = (q, [], [], kp.quantize_kv(k, quant).tensors(), kp.quantize_kv(v, quant).tensors(), quant,
                        0.25)
            for name, run in kernels.items():
                with self.subTest(name, quant=quant):
                    out, lse = run(*args)
                    self.assertTrue(out[0, :, 2:].isnan().all() and lse[0, 2:].isnan().all(), (out, lse))
                    self.assertTrue(torch.isfinite(out[0, :, :2]).all() and torch.isfinite(lse[0, :2]).all())
                    counts = torch.ones(16, dtype=I32)
                    counts[3] = 0  # the NaN row hidden
                    out, lse = run(*args[:7], counts)
                    self.assertTrue(torch.isfinite(out).all() and torch.isfinite(lse).all(), (name, quant))


if __name__ == "__main__":
    unittest.main()

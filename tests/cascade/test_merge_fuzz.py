"""Contract fuzzing of ``kvops.merge_attention_states`` and ``kvops.merge_attention_states_many`` with
``tests/errors/test_fuzz.py``'s machinery (hypothesis, derandomized, bounded): parts are strided views into buffers with
guard heads, some rows' LSEs are ``-inf`` (empty parts) or ``+inf`` (FlashAttention-2's empty part), LSEs come in
kvops' ``[H, T]`` layout or as the transposed view of FlashInfer's ``[T, H]``; valid calls against the fp64 merge
(``kvops/reference/merge.py``), each violation with its documented wording in eager, compile and export, and no input
ever changed."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

import kvops
from kvops.reference.merge import merge_states
from tests.errors.test_fuzz import DTYPES, FuzzCase, fuzz, rand

MERGE_BAD = ["out_dtype", "shape", "lse_dtype", "lse_layout", "rank"]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@st.composite
def merge_cases(draw, kind):
    t, h = draw(st.integers(0, 6)), draw(st.integers(1, 5))
    if kind == "lse_layout" and t == h:
        t += 1
    return dict(t=t, h=h, d=draw(st.sampled_from([1, 8, 80])), n=draw(st.integers(1, 4)),
                two=draw(st.booleans()), dtype=draw(st.sampled_from(DTYPES)), flashinfer=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)), kind=kind)


class TestFuzzMerge(FuzzCase):
    def test_merge(self):
        fuzz(self, merge_cases, MERGE_BAD, self.merge)

    def merge(self, c):
        gen = torch.Generator().manual_seed(c["seed"])
        n = 2 if c["two"] else c["n"]
        t, h, d, dtype = c["t"], c["h"], c["d"], c["dtype"]
        buf = rand((n, t, h + 2, d), dtype, gen)  # guard heads 0 and h + 1
        outs = buf[:, :, 1:-1]
        lses = torch.randn(n, h, t, generator=gen) * 3
        empty = torch.rand(n, h, t, generator=gen) < 0.3
        lses = lses.masked_fill(empty, float("-inf"))
        lses = torch.where(empty & (torch.rand(n, h, t, generator=gen) < 0.3), float("inf"), lses)
        outs[empty.permute(0, 2, 1)] = 0.0  # an empty part's out is 0 (as every producer writes it)
        if c["flashinfer"]:  # FlashInfer's [T, H] storage, passed as its transposed view
            lses = lses.transpose(1, 2).contiguous().transpose(1, 2)
        kind, error = c["kind"], None
        if kind == "out_dtype":
            outs, error = outs.double(), (ValueError, "must be float32, bfloat16 or float16, got torch.float64")
        elif kind == "shape":
            lses, error = lses[:, :, :0] if t else torch.zeros(n, h, 1), (ValueError, "must have shape")
        elif kind == "lse_dtype":
            lses, error = lses.double(), (ValueError, "must be float32 (the log-sum-exp in natural log")
        elif kind == "lse_layout":
            lses, error = lses.transpose(1, 2), (ValueError, "This is FlashInfer's [T, H] layout")
        elif kind == "rank":
            outs, error = outs[:, :, :, None], (ValueError, "D_v] (kvops.paged_attention's out), got shape")

        if c["two"]:
            def fn(o_a, lse_a, o_b, lse_b):
                return kvops.merge_attention_states(o_a, lse_a, o_b, lse_b)
            tensors = (outs[0], lses[0], outs[1], lses[1])
        else:
            def fn(outs, lses):
                return kvops.merge_attention_states_many(outs, lses)
            tensors = (outs, lses)

        def check(result):
            out, lse = result
            want_out, want_lse = merge_states(outs, lses)
            self.assertEqual((out.dtype, tuple(out.shape), lse.dtype), (dtype, (t, h, d), torch.float32))
            self.assertFalse(bool(out.isnan().any()) or bool(lse.isnan().any()))
            torch.testing.assert_close(out.double(), want_out, atol=TOL[dtype], rtol=TOL[dtype])
            torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)

        self.run_call("merge_attention_states" + ("" if c["two"] else "_many"), kind, fn, tensors, [buf, lses],
                      None, error, check)

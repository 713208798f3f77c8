"""The eager CPU path of kvops.paged_attention (``_eager_native`` in kvops/ops/paged_attention.py): the validator's
memo of passed signatures never hides an error, the native kernel's own value check stands in for the eager value
pass only where it raises the same errors, and the path's results are the dispatched op's, bit for bit.
"""

from __future__ import annotations

import importlib
import shutil
import unittest
import warnings

import torch

import kvops
from kvops._checks import paged_attention as checks
from kvops._checks import values
from tests import unhappy_ops_cases

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
I32 = torch.int32
op_module = importlib.import_module("kvops.ops.paged_attention")  # (the package re-exports the function)


def base():
    """A valid call: 3 query rows of 2 sequences, 4 query heads over 2 KV heads of head_dim 8, P = 4 blocks of 4."""
    g = torch.Generator().manual_seed(0)
    return dict(q=torch.randn(3, 4, 8, generator=g), k_cache=torch.randn(4, 4, 2, 8, generator=g),
                v_cache=torch.randn(4, 4, 2, 8, generator=g), cu_seqlens_q=torch.tensor([0, 1, 3], dtype=I32),
                seq_lens=torch.tensor([3, 6], dtype=I32), block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32),
                max_seqlen_q=2)


def outcome(call) -> str:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the outcome is what is compared
        return f"{type(e).__name__}: {e}"
    return "ok"


# one change each to the base call: the validator's errors (metadata and scalar arguments) and a few valid variants
MUTATIONS = {
    "q heads not a multiple of the KV heads": dict(q=torch.randn(3, 3, 8)),
    "q head_dim": dict(q=torch.randn(3, 4, 16)),
    "q float64": dict(q=torch.randn(3, 4, 8, dtype=torch.float64)),
    "q bfloat16 (caches float32)": dict(q=torch.randn(3, 4, 8).bfloat16()),
    "v_cache missing": dict(v_cache=None),
    "v_cache blocks": dict(v_cache=torch.randn(5, 4, 2, 8)),
    "v_cache head_dim 16 (valid)": dict(v_cache=torch.randn(4, 4, 2, 16)),
    "kv_layout": dict(kv_layout="NDH"),
    "kv_layout HND (passes the validator, not the value contract: block_size 2)": dict(kv_layout="HND"),
    "cu_seqlens_q batch": dict(cu_seqlens_q=torch.tensor([0, 3], dtype=I32)),
    "seq_lens int64": dict(seq_lens=torch.tensor([3, 6])),
    "block_table 1-D": dict(block_table=torch.tensor([0, 1, 2, 3], dtype=I32)),
    "max_seqlen_q 0": dict(max_seqlen_q=0),
    "window_left -2": dict(window_left=-2),
    "window_left 2 (valid)": dict(window_left=2),
    "softcap -1": dict(softcap=-1.0),
    "softcap nan": dict(softcap=float("nan")),
    "scale inf": dict(scale=float("inf")),
    "scale 0.5 (valid)": dict(scale=0.5),
    "sinks shape": dict(sinks=torch.zeros(3)),
    "sinks (valid)": dict(sinks=torch.zeros(4)),
    "k_scale without fp8": dict(k_scale=torch.ones(1), v_scale=torch.ones(1)),
    "alibi_slopes shape": dict(alibi_slopes=torch.ones(3)),
    "alibi_slopes (valid)": dict(alibi_slopes=torch.ones(2, 4)),
    "window_right -3": dict(window_right=-3),
    "cache_leftpad int64": dict(cache_leftpad=torch.zeros(2, dtype=torch.int64)),
    "sink_tokens -1": dict(sink_tokens=-1),
    "rope_theta -1": dict(rope_theta=-1.0),
    "rope_theta (valid)": dict(rope_theta=1e4),
    "custom_mask uint8": dict(custom_mask=torch.ones(5, dtype=torch.uint8)),
    "custom_mask with window_right": dict(custom_mask=torch.ones(5, dtype=torch.bool), causal=False, window_right=1),
    "custom_mask too long": dict(custom_mask=torch.ones(7, dtype=torch.bool)),
}


@unittest.skipUnless(HAS_COMPILER, "no C++ compiler on this machine: the composite fallback is what runs")
class TestEagerPath(unittest.TestCase):
    def setUp(self):
        self.assertTrue(kvops.native.available())
        checks._PASSED.clear()

    def test_memo_never_hides_an_error(self):
        # each variant's outcome (error type and message, or success) is the same with no signature remembered, after
        # the valid base call and every other variant were remembered, and on a second call
        calls = {name: (lambda change=change: kvops.paged_attention(**{**base(), **change}))
                 for name, change in MUTATIONS.items()}
        fresh = {}
        for name, call in calls.items():
            checks._PASSED.clear()
            fresh[name] = outcome(call)
        self.assertEqual([n for n, o in fresh.items() if o == "ok"], [n for n in MUTATIONS if "(valid" in n], fresh)
        checks._PASSED.clear()
        kvops.paged_attention(**base())
        for name, call in calls.items():
            with self.subTest(variant=name):
                self.assertEqual(outcome(call), fresh[name])
                self.assertEqual(outcome(call), fresh[name])
        # remembered: the base call, the valid variants and the one that passes the validator; never a failing one
        self.assertEqual(len(checks._PASSED), 2 + sum("(valid" in n for n in MUTATIONS))

    def test_memo_tells_number_types_apart(self):
        # require_finite checks Python numbers only: a numpy float32 inf passes the validator, a Python inf never
        import numpy as np

        outcome(lambda: kvops.paged_attention(**base(), scale=np.float32("inf")))
        with self.assertRaisesRegex(ValueError, "scale must be a finite number"):
            kvops.paged_attention(**base(), scale=float("inf"))

    def test_memo_never_hides_a_generated_case(self):
        # the unhappy-path generator's cases of paged_attention (tests/unhappy_ops_cases.py), in this process: the
        # same outcome with an empty memo and after the valid base call filled it
        cases = [c for c in unhappy_ops_cases.generate() if c.name.startswith("paged_attention")]
        self.assertGreater(len(cases), 20)
        fn, make = unhappy_ops_cases._base_calls()["paged_attention"]
        for case in cases:
            with self.subTest(case=case.name), kvops.value_checks(case.mode or "eager"):
                checks._PASSED.clear()
                first = outcome(case.build()[0])
                fn(make())  # the valid base call: its signature is remembered
                self.assertEqual(outcome(case.build()[0]), first)

    def test_memo_is_bounded(self):
        for n in range(1, checks.MEMO_SIZE + 40):
            a = base()
            a["block_table"] = torch.zeros(2, n + 1, dtype=I32)
            kvops.paged_attention(**a)
            self.assertLessEqual(len(checks._PASSED), checks.MEMO_SIZE)

    def test_value_errors_of_the_eager_mode(self):
        # every q_len <= max_seqlen_q: the kernel's check stands in for the value pass, with the value pass's messages
        # word for word; else the value pass runs (q_len <= max_seqlen_q is the eager mode's alone)
        q, k, v = torch.randn(1, 2, 8), torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8)
        bad = [([0, 1], [9], [[0, 1]]), ([0, 1], [8], [[0, 99]]), ([0, 1], [5], [[-5, 1]]), ([0, 1000], [8], [[0, 1]]),
               ([0, 1], [-3], [[0, 1]]), ([1, 1], [3], [[0, 1]])]
        for cu, lens, table in bad:
            cu, lens, table = (torch.tensor(x, dtype=I32) for x in (cu, lens, table))
            with self.subTest(cu=cu.tolist(), lens=lens.tolist(), table=table.tolist()):
                with self.assertRaises(RuntimeError) as call:
                    kvops.paged_attention(q, k, v, cu, lens, table, max_seqlen_q=1)
                with self.assertRaises(RuntimeError) as value_pass:
                    values.check_paged_attention(q, k, cu, lens, table, 1)
                self.assertEqual(str(call.exception), str(value_pass.exception))
        # T_q > max_seqlen_q (decode of 2 sequences, a prefill chunk beside a decode): q_len read from cu_seqlens_q
        q3 = torch.randn(3, 2, 8)
        two = [([0, 1, 2], [4, 8], [[0, 1], [2, 9]], 1), ([0, 1, 3], [4, 9], [[0, 1], [2, 3]], 2),
               ([0, 2, 1], [4, 4], [[0, 1], [2, 3]], 1), ([0, 3, 2], [4, 4], [[0, 1], [2, 3]], 1)]
        for cu, lens, table, max_q in two:
            cu, lens, table = (torch.tensor(x, dtype=I32) for x in (cu, lens, table))
            with self.subTest(cu=cu.tolist(), lens=lens.tolist(), table=table.tolist(), max_seqlen_q=max_q):
                with self.assertRaises(RuntimeError) as call:
                    kvops.paged_attention(q3, k, v, cu, lens, table, max_seqlen_q=max_q)
                with self.assertRaises(RuntimeError) as value_pass:
                    values.check_paged_attention(q3, k, cu, lens, table, max_q)
                self.assertEqual(str(call.exception), str(value_pass.exception))
        self.assertIn("cu_seqlens_q = [0, 3, 2] must be non-decreasing", str(value_pass.exception))  # before q_len
        q2 = torch.randn(2, 2, 8)
        args = (q2, k, v, torch.tensor([0, 2], dtype=I32), torch.tensor([4], dtype=I32),
                torch.tensor([[0, 1]], dtype=I32))
        with self.assertRaisesRegex(RuntimeError, "sequence 0 has q_len 2 .* but max_seqlen_q=1"):
            kvops.paged_attention(*args, max_seqlen_q=1)
        with kvops.value_checks("off"):  # not a contract the kernel addresses memory with
            self.assertEqual(kvops.paged_attention(*args, max_seqlen_q=1).shape, (2, 2, 8))
        self.assertTrue(values.native_checks_all(q3, torch.tensor([0, 1, 3], dtype=I32), 2))
        self.assertFalse(values.native_checks_all(q3, torch.tensor([0, 1, 3], dtype=I32), 1))
        self.assertFalse(values.native_checks_all(q3, torch.tensor([0, 1, 3], dtype=I32), 3, torch.zeros(2, dtype=I32)))

    def test_results_are_the_dispatched_ops(self):
        for name, change in MUTATIONS.items():
            a = {**base(), **change}
            if "(valid" not in name:
                continue
            with self.subTest(variant=name):
                tensors = [x for x in a.values() if isinstance(x, torch.Tensor)]
                self.assertTrue(op_module._direct(tensors))
                direct = kvops.paged_attention(**a, return_lse=True)
                with kvops.value_checks("off"), torch.profiler.profile() as prof:  # a profile: the dispatcher
                    dispatched = kvops.paged_attention(**a, return_lse=True)
                self.assertIn("kvops::paged_attention", [e.name for e in prof.events()])
                self.assertTrue(torch.equal(direct[0], dispatched[0]) and torch.equal(direct[1], dispatched[1]))
                self.assertTrue(torch.equal(kvops.paged_attention(**a), dispatched[0]))  # no LSE: the same out

    def test_eager_entry_is_the_native_op_without_the_dispatcher(self):
        # what _eager_native calls without features: kvops::_paged_attention_native's kernel, its results bit for
        # bit, its errors (type and message) for bad index values and bad metadata alike
        from kvops import native

        self.assertTrue(native.available())
        self.assertIsNotNone(native.eager_entry)
        a = base()
        args = [a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"], a["block_table"], 2, 0.3, True,
                -1, 0.0, None, None, None]
        op = torch.ops.kvops._paged_attention_native.default
        direct, dispatched = native.eager_entry(*args, True), op(*args)
        self.assertTrue(torch.equal(direct[0], dispatched[0]) and torch.equal(direct[1], dispatched[1]))
        self.assertTrue(torch.equal(native.eager_entry(*args, False), dispatched[0]))  # out alone: no LSE tensor
        for i, bad in ((5, torch.tensor([[9, 1], [2, 3]], dtype=I32)), (4, torch.tensor([3, 99], dtype=I32)),
                       (3, torch.tensor([0, 2, 1], dtype=I32)), (5, torch.tensor([[0, 1], [2, 3]])),
                       (11, torch.zeros(3))):
            changed = [*args[:i], bad, *args[i + 1:]]
            with self.subTest(argument=i):
                for return_lse in (True, False):
                    self.assertEqual(outcome(lambda: native.eager_entry(*changed, return_lse)),
                                     outcome(lambda: op(*changed)))
                self.assertTrue(outcome(lambda: op(*changed)).startswith("RuntimeError: "))

    def test_eager_key_admits_what_direct_admits_and_names_the_metadata(self):
        # native.eager_key: None for a tensor the dispatcher must see; else the same key exactly when every argument
        # has the same dtype and shape (values and strides are not the validator's business)
        from kvops import native

        self.assertTrue(native.available())
        key, q = native.eager_key, torch.randn(3, 4, 8)
        self.assertEqual(key(q, None), key(torch.zeros(3, 4, 8), None))
        self.assertEqual(key(q, None), key(torch.randn(3, 8, 4).transpose(1, 2), None))
        self.assertNotEqual(key(q, None), key(None, q))
        for other in (torch.randn(3, 4, 9), torch.randn(3, 32), q.double(), q.bfloat16(), torch.randn(1, 3, 4, 8)):
            self.assertNotEqual(key(q, None), key(other, None))
        self.assertIsNone(key(q, q.clone().requires_grad_()))
        with torch.no_grad():
            self.assertIsNotNone(key(q, q.clone().requires_grad_()))
        self.assertIsNone(key(torch.nn.Parameter(q)))
        self.assertIsNone(key(q.to("meta")))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the strided nested layout's prototype notice)
            nested = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)])
        self.assertIsNone(key(nested))
        self.assertTrue(op_module._direct((q, None)))
        self.assertFalse(op_module._direct((torch.nn.Parameter(q),)))


if __name__ == "__main__":
    unittest.main()

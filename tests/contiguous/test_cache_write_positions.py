"""``kvops.cache_write`` with the start row as a tensor (compiled generate loops keep positions in tensors, as gpt-fast's
``input_pos``): bit-exact against the int form and a per-element reference, one compiled graph for every position (no
host sync, no graph break), the rows checked per the value-check mode, contracts in eager, compile and export."""

from __future__ import annotations

import itertools
import unittest

import expecttest
import torch
from torch._dynamo.testing import CompileCounter

import kvops
from tests.contract import _Wrap, raises_everywhere
from tests.contiguous.test_contiguous_ops import SENTINEL, make_caches, ref_write

PY_ERROR = torch._dynamo.exc.Unsupported  # the tensor form's checks run in Python before the paged write op


def ref_rows(k_cache, v_cache, key, value, rows, h0):
    """Token ``t`` of every sequence into row ``rows[t]``, one (b, t, h) at a time."""
    k, v = k_cache.clone(), v_cache.clone()
    for b, t, h in itertools.product(range(key.shape[0]), range(key.shape[1]), range(key.shape[2])):
        k[b, rows[t], h0 + h] = key[b, t, h]
        v[b, rows[t], h0 + h] = value[b, t, h]
    return k, v


class TestTensorStart(unittest.TestCase):
    def test_matches_the_int_form(self):
        cases = [  # (B, S, H_cache, H_in, D, D_v, start, T, cache_head_start, layout)
            (2, 16, 4, 4, 64, 64, 0, 5, None, "separate"),
            (1, 9, 5, 1, 80, 80, 8, 1, 4, "separate"),  # head_dim 80, one head of five, last row
            (2, 12, 6, 2, 80, 48, 3, 7, 2, "separate"),  # D_v != D
            (3, 8, 4, 4, 16, 16, 2, 0, None, "separate"),  # zero tokens
            (2, 10, 4, 3, 32, 32, 1, 4, 1, "joint"),  # K/V views of one [B, S, 2, H, D] allocation
            (1, 7, 3, 3, 8, 8, 4, 3, None, "head_slice"),  # strided view of a wider cache
        ]
        for dtype, case, form in itertools.product((torch.float32, torch.bfloat16), cases, ("0d", "[1]", "int32")):
            b, s, hc, hi, d, dv, start, t, h0, layout = case
            with self.subTest(dtype=dtype, case=case, form=form):
                k_cache, v_cache = make_caches(b, s, hc, d, dv, dtype, layout)
                key, value = torch.randn(b, t, hi, d).to(dtype), torch.randn(b, t, hi, dv).to(dtype)
                want_k, want_v = ref_write(k_cache, v_cache, key, value, start, h0 or 0)
                pos = {"0d": torch.tensor(start), "[1]": torch.tensor([start]),
                       "int32": torch.tensor(start, dtype=torch.int32)}[form]
                kvops.cache_write(key, value, k_cache, v_cache, pos, cache_head_start=h0)
                self.assertTrue(torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v))

    def test_one_row_per_token(self):
        """A ``[T]`` tensor gives each token's row (gpt-fast's ``k_cache[:, :, input_pos] = k_val``), in any order."""
        for rows in ([5, 0, 3], [0, 1, 2, 3], [7, 6]):
            k_cache, v_cache = make_caches(2, 8, 3, 8, layout="joint")
            key, value = torch.randn(2, len(rows), 3, 8), torch.randn(2, len(rows), 3, 8)
            want = ref_rows(k_cache, v_cache, key, value, rows, 0)
            kvops.cache_write(key, value, k_cache, v_cache, torch.tensor(rows))
            self.assertTrue(torch.equal(k_cache, want[0]) and torch.equal(v_cache, want[1]), rows)

    def test_gpt_fast_layout(self):
        """gpt-fast's caches are ``[B, H, S, D]``: their ``transpose(1, 2)`` views are written in place."""
        k_buf, v_buf = torch.zeros(2, 4, 16, 8), torch.zeros(2, 4, 16, 8)
        k_val, v_val = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8)  # [B, H, T, D], as gpt-fast's update gets
        input_pos = torch.arange(5, 8)
        want_k, want_v = k_buf.clone(), v_buf.clone()
        want_k[:, :, input_pos], want_v[:, :, input_pos] = k_val, v_val  # gpt-fast's own update
        kvops.cache_write(k_val.transpose(1, 2), v_val.transpose(1, 2), k_buf.transpose(1, 2), v_buf.transpose(1, 2),
                          input_pos)
        self.assertTrue(torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v))


class TestCompiled(unittest.TestCase):
    def test_one_graph_for_every_position(self):
        for form in ("start", "rows"):
            torch._dynamo.reset()
            counter = CompileCounter()
            eager, compiled = make_caches(2, 24, 4, 8), make_caches(2, 24, 4, 8)

            def step(x, kc, vc, pos):
                kvops.cache_write(x * 2, -x, kc, vc, pos)

            f = torch.compile(step, fullgraph=True, backend=counter)
            for s in range(0, 20, 2):
                x = torch.randn(2, 2, 4, 8)
                pos = torch.tensor(s) if form == "start" else torch.tensor([s + 1, s])
                step(x, *eager, pos)
                f(x, *compiled, pos)
            self.assertEqual(counter.frame_count, 1, form)
            self.assertTrue(torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1]))

    def test_inductor_matches_eager(self):
        torch._dynamo.reset()
        eager, compiled = make_caches(2, 10, 4, 8, layout="joint"), make_caches(2, 10, 4, 8, layout="joint")

        def step(x, kc, vc, pos):
            kvops.cache_write(x * 2, -x, kc, vc, pos, cache_head_start=1)

        f = torch.compile(step, fullgraph=True)
        for s in (3, 7):
            x = torch.randn(2, 3, 2, 8)
            step(x, *eager, torch.tensor(s))
            f(x, *compiled, torch.tensor(s))
        self.assertTrue(torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1]))


class TestContracts(expecttest.TestCase):
    def setUp(self):
        self.k_cache, self.v_cache = make_caches(2, 8, 4, 16)
        self.key = torch.randn(2, 3, 4, 16)

    def check(self, exc, pos, key=None):
        key = self.key if key is None else key
        msg = raises_everywhere(self, exc, lambda k, kc, vc, p: kvops.cache_write(k, k, kc, vc, p),
                                (key, self.k_cache, self.v_cache, pos), compile_exc=PY_ERROR)
        self.assertTrue(bool((self.k_cache == SENTINEL).all() and (self.v_cache == SENTINEL).all()))  # unwritten
        return msg

    def test_start_metadata(self):
        self.assertExpectedInline(self.check(ValueError, torch.tensor(2.0)), """kvops.cache_write: start must be an int, or an int32/int64 tensor holding the first row ([] or [1]) or one row per new token ([num_new_tokens] = [3], as gpt-fast's input_pos); got a tensor of shape () and dtype torch.float32. Pass start.to(torch.int64) (built with integer ops: // rather than /).""")
        self.assertExpectedInline(self.check(ValueError, torch.tensor([1, 2])), """kvops.cache_write: start must be an int, or an int32/int64 tensor holding the first row ([] or [1]) or one row per new token ([num_new_tokens] = [3], as gpt-fast's input_pos); got a tensor of shape (2,) and dtype torch.int64. Pass start with the shape [1] or [3].""")
        self.assertExpectedInline(self.check(ValueError, torch.zeros(1, 1, dtype=torch.int64)), """kvops.cache_write: start must be an int, or an int32/int64 tensor holding the first row ([] or [1]) or one row per new token ([num_new_tokens] = [3], as gpt-fast's input_pos); got a tensor of shape (1, 1) and dtype torch.int64. Pass start with the shape [1] or [3].""")
        self.assertExpectedInline(self.check(RuntimeError, torch.tensor(0), torch.randn(2, 9, 4, 16)), """Invalid kvops.cache_write write range: num_new_tokens=9 exceeds kv_cache_size=8, so no start row fits. Rows must satisfy 0 <= start and start + num_new_tokens <= kv_cache_size. Write at most 8 tokens per call, or allocate a cache of at least 9 rows.""")
        # the cache's own contract comes first, as in the int form
        msg = self.check(ValueError, torch.tensor(0), torch.randn(2, 3, 4, 8))
        self.assertIn("head_dim", msg)

    def test_value_contract_eager(self):
        f = kvops.cache_write
        for pos in (torch.tensor(6), torch.tensor([-1]), torch.tensor([1, 8, 2])):
            with self.assertRaises(RuntimeError) as cm:
                f(self.key, self.key, self.k_cache, self.v_cache, pos)
            self.assertTrue(bool((self.k_cache == SENTINEL).all()))
        self.assertExpectedInline(str(cm.exception), """kvops.cache_write: start[1] = 8 is outside [0, 8), the rows of the cache (kv_cache_size=8); nothing was written. Pass one row in [0, kv_cache_size) per new token.""")
        with self.assertRaises(RuntimeError) as cm:
            f(self.key, self.key, self.k_cache, self.v_cache, torch.tensor(6))
        # the int form's message, word for word
        with self.assertRaises(RuntimeError) as int_cm:
            f(self.key, self.key, self.k_cache, self.v_cache, 6)
        self.assertEqual(str(cm.exception), str(int_cm.exception))

    def test_value_contract_async_compiled_and_exported(self):
        def call(k, kc, vc, pos):
            kvops.cache_write(k, k, kc, vc, pos)

        bad = torch.tensor(6)
        with kvops.value_checks("async"):
            with self.assertRaisesRegex(RuntimeError, r"start names rows outside \[0, kv_cache_size = 8\)"):
                call(self.key, self.k_cache, self.v_cache, bad)
            torch._dynamo.reset()
            compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
            compiled(self.key, *make_caches(2, 8, 4, 16), torch.tensor(5))
            with self.assertRaisesRegex(RuntimeError, r"start names rows outside"):
                compiled(self.key, self.k_cache, self.v_cache, bad)
            ep = torch.export.export(_Wrap(call), (self.key, *make_caches(2, 8, 4, 16), torch.tensor(0)))
        with self.assertRaisesRegex(RuntimeError, r"start names rows outside"):
            ep.module()(self.key, self.k_cache, self.v_cache, bad)
        self.assertTrue(bool((self.k_cache == SENTINEL).all() and (self.v_cache == SENTINEL).all()))

    def test_unchecked_rows_outside_the_cache_are_skipped(self):
        with kvops.value_checks("off"):
            kvops.cache_write(self.key, self.key, self.k_cache, self.v_cache, torch.tensor(6))
        self.assertTrue(torch.equal(self.k_cache[:, 6:8], self.key[:, :2]))  # rows 6, 7 written; row 8 skipped
        self.assertTrue(bool((self.k_cache[:, :6] == SENTINEL).all()))


if __name__ == "__main__":
    unittest.main()

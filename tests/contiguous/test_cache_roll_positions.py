"""``kvops.cache_roll`` with tensor positions (compiled streaming loops keep their cursors in tensors): bit-exact
against the int form and a per-row reference, one compiled graph for every position (no host sync, no graph break),
the rows checked per the value-check mode, contracts in eager, compile and export."""

from __future__ import annotations

import itertools
import unittest

import expecttest
import torch
from torch._dynamo.testing import CompileCounter

import kvops
from tests.contract import _Wrap, raises_everywhere
from tests.contiguous.test_contiguous_ops import make_caches, ref_roll

PY_ERROR = torch._dynamo.exc.Unsupported  # the tensor form's checks run in Python before the paged write op


def random_caches(b, s, h, d, d_v=None, dtype=torch.float32, layout="separate", seed=0):
    """``make_caches`` with distinct values in every row (so a row moved to the wrong place shows)."""
    k_cache, v_cache = make_caches(b, s, h, d, d_v, dtype, layout)
    g = torch.Generator().manual_seed(seed)
    for cache in (k_cache, v_cache):
        cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    return k_cache, v_cache


def forms(src, dst, n):
    """The argument forms of one move: each position an int, a 0-d int64, a ``[1]`` or an int32 tensor."""
    t = torch.tensor
    return {"src": (t(src), dst, n), "num_tokens": (src, dst, t(n)), "all 0-d": (t(src), t(dst), t(n)),
            "[1] and int32": (t([src]), t(dst, dtype=torch.int32), t([n], dtype=torch.int32))}


class TestTensorPositions(unittest.TestCase):
    def test_matches_the_int_form_and_the_reference(self):
        cases = [  # (B, S, H, D, D_v, src, dst, n, cache_head_start, num_heads, layout)
            (2, 16, 4, 64, 64, 6, 2, 9, None, None, "separate"),  # eviction after a sink of 2: overlapping, down
            (1, 9, 5, 80, 48, 1, 4, 5, 4, 1, "separate"),  # overlapping, up; head_dim 80, D_v != D, the last head
            (2, 10, 4, 32, 32, 3, 0, 7, 1, 2, "joint"),  # K/V views of one [B, S, 2, H, D] allocation
            (1, 7, 3, 8, 8, 0, 4, 3, None, None, "head_slice"),  # strided view of a wider cache, disjoint ranges
            (3, 8, 2, 16, 16, 2, 5, 0, None, None, "separate"),  # nothing moved
            (1, 6, 2, 4, 4, 0, 0, 6, None, None, "separate"),  # every row onto itself
            (1, 1, 1, 4, 4, 0, 0, 1, None, None, "separate"),  # a one-row cache
        ]
        for dtype, case in itertools.product((torch.float32, torch.bfloat16), cases):
            b, s, h, d, dv, src, dst, n, h0, nh, layout = case
            for form, args in forms(src, dst, n).items():
                with self.subTest(dtype=dtype, case=case, form=form):
                    k_cache, v_cache = random_caches(b, s, h, d, dv, dtype, layout)
                    lo, hi = h0 or 0, (h0 or 0) + (nh or h - (h0 or 0))
                    want = ref_roll(k_cache, src, dst, n, lo, hi), ref_roll(v_cache, src, dst, n, lo, hi)
                    ints = k_cache.clone(), v_cache.clone()
                    kvops.cache_roll(*ints, src, dst, n, cache_head_start=h0, num_heads=nh)
                    kvops.cache_roll(k_cache, v_cache, *args, cache_head_start=h0, num_heads=nh)
                    self.assertTrue(torch.equal(k_cache, want[0]) and torch.equal(v_cache, want[1]))
                    self.assertTrue(torch.equal(k_cache, ints[0]) and torch.equal(v_cache, ints[1]))

    def test_joint_allocation_other_rows_and_half_untouched(self):
        kv = torch.randn(1, 8, 2, 2, 4)
        before = kv.clone()
        kvops.cache_roll(kv[:, :, 0], kv[:, :, 1], torch.tensor(5), torch.tensor(3), torch.tensor(2))
        self.assertTrue(torch.equal(kv[:, 3:5], before[:, 5:7]))
        self.assertTrue(torch.equal(kv[:, :3], before[:, :3]) and torch.equal(kv[:, 5:], before[:, 5:]))


class TestCompiled(unittest.TestCase):
    def test_one_graph_for_every_position(self):
        """The eviction of a streaming cache with a sink of 2 rows, ``src``/``num_tokens`` advancing: one graph."""
        torch._dynamo.reset()
        counter = CompileCounter()

        def evict(kc, vc, src, n):
            kvops.cache_roll(kc, vc, src, 2, n)

        f = torch.compile(evict, fullgraph=True, backend=counter)
        eager = random_caches(2, 12, 3, 8, 4)
        compiled = [c.clone() for c in eager]
        for src, n in ((5, 7), (2, 0), (3, 9), (11, 1), (4, 0)):
            kvops.cache_roll(*eager, src, 2, n)
            f(*compiled, torch.tensor(src), torch.tensor(n))
            self.assertTrue(torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1]), (src, n))
        self.assertEqual(counter.frame_count, 1)

    def test_inductor_matches_eager(self):
        torch._dynamo.reset()

        def step(x, kc, vc, src, dst, n):  # a producer, the move, then a read of the moved rows
            kvops.cache_roll(kc, vc, src, dst, n, cache_head_start=1)
            return kc.sum(dim=(1, 3)) + x

        f = torch.compile(step, fullgraph=True)
        eager, compiled = random_caches(2, 10, 4, 8, layout="joint"), random_caches(2, 10, 4, 8, layout="joint")
        x = torch.randn(2, 4)
        for src, dst, n in ((4, 1, 6), (1, 4, 6), (0, 9, 1), (3, 3, 4)):
            want = step(x, *eager, src, dst, n)
            got = f(x, *compiled, torch.tensor(src), torch.tensor(dst), torch.tensor(n))
            self.assertTrue(torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1]))
            torch.testing.assert_close(got, want)


class TestContracts(expecttest.TestCase):
    def setUp(self):
        self.k_cache, self.v_cache = random_caches(2, 8, 4, 16)
        self.before = self.k_cache.clone(), self.v_cache.clone()

    def unchanged(self) -> bool:
        return torch.equal(self.k_cache, self.before[0]) and torch.equal(self.v_cache, self.before[1])

    def check(self, exc, src, dst, n, k_cache=None, v_cache=None):
        k_cache = self.k_cache if k_cache is None else k_cache
        v_cache = self.v_cache if v_cache is None else v_cache
        msg = raises_everywhere(self, exc, lambda kc, vc, a, b, c: kvops.cache_roll(kc, vc, a, b, c),
                                (k_cache, v_cache, src, dst, n), compile_exc=PY_ERROR)
        self.assertTrue(self.unchanged())
        return msg

    def test_position_metadata(self):
        t = torch.tensor
        self.assertExpectedInline(self.check(ValueError, t(2.0), 0, 1), """kvops.cache_roll: src must be an int or an int32/int64 tensor holding one row count or row ([] or [1]); got a tensor of shape () and dtype torch.float32. Pass src.to(torch.int64) (built with integer ops: // rather than /).""")  # noqa: B950
        self.assertExpectedInline(self.check(ValueError, 2, t([0, 1]), 1), """kvops.cache_roll: dst must be an int or an int32/int64 tensor holding one row count or row ([] or [1]); got a tensor of shape (2,) and dtype torch.int64. Pass dst with the shape [] or [1].""")  # noqa: B950
        self.assertExpectedInline(self.check(ValueError, 2, 0, t([[1]])), """kvops.cache_roll: num_tokens must be an int or an int32/int64 tensor holding one row count or row ([] or [1]); got a tensor of shape (1, 1) and dtype torch.int64. Pass num_tokens with the shape [] or [1].""")  # noqa: B950
        # the caches' own contract comes first, as in the int form
        msg = self.check(ValueError, t(2), 0, 1, v_cache=torch.zeros(2, 8, 3, 16))
        self.assertIn("must agree in [batch, cache_len, num_kv_heads]", msg)

    def test_one_tensor_as_both_caches_and_fp8(self):
        """The int form moves ``k_cache is v_cache`` and fp8 rows as plain copies; the tensor form's cache write
        cannot (it needs two caches and quantizes into fp8): a ValueError naming the int form."""
        self.assertExpectedInline(self.check(ValueError, torch.tensor(2), 0, 1, v_cache=self.k_cache), """kvops.cache_roll: k_cache is v_cache; with tensor positions the rows are moved by a cache write, which needs two distinct caches. Pass int positions to roll one tensor as both caches, or pass separate K and V caches.""")  # noqa: B950
        fp8 = torch.zeros(1, 4, 1, 8, dtype=torch.float8_e4m3fn), torch.zeros(1, 4, 1, 8, dtype=torch.float8_e4m3fn)
        with self.assertRaisesRegex(ValueError, "cannot be moved with tensor positions.*Pass int positions"):
            kvops.cache_roll(*fp8, torch.tensor(1), 0, 2)
        kvops.cache_roll(*fp8, 1, 0, 2)  # the int form still works

    def test_value_contract_eager_is_the_int_forms_message(self):
        for src, dst, n in ((6, 0, 3), (0, 7, 2), (-1, 0, 1), (0, 0, -1), (0, 0, 9)):
            for form, args in forms(src, dst, n).items():
                with self.subTest(src=src, dst=dst, n=n, form=form):
                    with self.assertRaises(RuntimeError) as cm:
                        kvops.cache_roll(self.k_cache, self.v_cache, *args)
                    with self.assertRaises(RuntimeError) as int_cm:
                        kvops.cache_roll(self.k_cache, self.v_cache, src, dst, n)
                    self.assertEqual(str(cm.exception), str(int_cm.exception))
                    self.assertTrue(self.unchanged())
        self.assertExpectedInline(str(cm.exception), """Invalid kvops.cache_roll range: src=[0, 9), dst=[0, 9), kv_cache_size=8, num_tokens=9. Both ranges must lie in [0, kv_cache_size) and num_tokens must be >= 0.""")  # noqa: B950

    def test_value_contract_async_compiled_and_exported(self):
        def call(kc, vc, src, n):
            kvops.cache_roll(kc, vc, src, 1, n)

        t = torch.tensor
        with kvops.value_checks("async"):
            with self.assertRaisesRegex(RuntimeError, r"num_tokens names rows outside \[0, kv_cache_size = 8\)"):
                call(self.k_cache, self.v_cache, t(6), t(3))
            self.assertTrue(self.unchanged())
            for backend in ("aot_eager", "inductor"):
                torch._dynamo.reset()
                compiled = torch.compile(call, fullgraph=True, backend=backend)
                with self.assertRaisesRegex(RuntimeError, "names rows outside"):
                    compiled(self.k_cache, self.v_cache, t(6), t(3))
                self.assertTrue(self.unchanged(), backend)
                compiled(self.k_cache, self.v_cache, t(2), t(3))  # the same graph moves a valid range
                self.assertTrue(torch.equal(self.k_cache[:, 1:4], self.before[0][:, 2:5]), backend)
                self.k_cache.copy_(self.before[0]), self.v_cache.copy_(self.before[1])
            ep = torch.export.export(_Wrap(call), (*random_caches(2, 8, 4, 16), t(0), t(0)))
        self.assertIn("_assert_async", str(ep.graph))
        with self.assertRaisesRegex(RuntimeError, "names rows outside"):
            ep.module()(self.k_cache, self.v_cache, t(-1), t(2))
        self.assertTrue(self.unchanged())

    def test_unchecked_rows_outside_the_cache_are_skipped(self):
        """Modes "off" (and compiled code in "eager" mode): only rows whose source and destination lie in the cache
        move; nothing outside the cache is read or written, ``n < 0`` moves nothing."""
        f = torch.compile(lambda kc, vc, a, b, c: kvops.cache_roll(kc, vc, a, b, c), fullgraph=True)
        t = torch.tensor
        for name, roll in (("off", kvops.cache_roll), ("compiled", f)):
            for src, dst, n, moved in ((6, 1, 4, (1, 3, 6)), (1, 6, 4, (6, 8, 1)), (-2, 0, 4, (2, 4, 0)),
                                       (2, 0, -3, None)):
                mode = "off" if name == "off" else "eager"
                with self.subTest(name=name, src=src, dst=dst, n=n), kvops.value_checks(mode):
                    torch._dynamo.reset()
                    self.k_cache.copy_(self.before[0]), self.v_cache.copy_(self.before[1])
                    roll(self.k_cache, self.v_cache, t(src), t(dst), t(n))
                    want = self.before[0].clone()
                    if moved is not None:  # rows [a, b) now hold the rows from c on
                        a, b, c = moved
                        want[:, a:b] = self.before[0][:, c : c + b - a]
                    self.assertTrue(torch.equal(self.k_cache, want))


if __name__ == "__main__":
    unittest.main()

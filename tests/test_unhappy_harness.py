"""The unhappy-path harness itself (tests/unhappy.py) catches what it is meant to catch."""

import unittest

import torch

import kvops
from tests.unhappy import check_failing_call, run_isolated


class TestHarness(unittest.TestCase):
    def test_detects_a_write_before_the_raise(self):
        cache = kvops.CausalKVCache(torch.zeros(1, 8, 2, 4), torch.zeros(1, 8, 2, 4))

        def bad():
            cache.k[0, 0, 0, 0] = 1.0
            raise ValueError("key bad")

        with self.assertRaisesRegex(AssertionError, "contents changed"):
            check_failing_call(self, bad, ValueError, ["key"], state=cache)

    def test_detects_a_cursor_move_and_a_wrong_type(self):
        cache = kvops.CausalKVCache(torch.zeros(1, 8, 2, 4), torch.zeros(1, 8, 2, 4))
        snap_attr = next(n for n, v in vars(cache).items() if isinstance(v, int) and not isinstance(v, bool))

        def bad():
            setattr(cache, snap_attr, getattr(cache, snap_attr) + 1)
            raise ValueError("bad")

        with self.assertRaisesRegex(AssertionError, snap_attr):
            check_failing_call(self, bad, ValueError, state=cache)
        with self.assertRaisesRegex(AssertionError, "expected TypeError, got ValueError"):
            check_failing_call(self, lambda: (_ for _ in ()).throw(ValueError("v")), TypeError)

    def test_unchanged_nan_state_passes(self):
        x = torch.full((4,), float("nan"))

        def bad():
            raise ValueError("x is bad")

        self.assertEqual(check_failing_call(self, bad, ValueError, ["x"], state={"x": x}), "x is bad")

    def test_run_isolated_reports_a_signal(self):
        with self.assertRaisesRegex(AssertionError, "SIGSEGV"):
            run_isolated("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
        self.assertEqual(run_isolated("print(1)").stdout, "1\n")


if __name__ == "__main__":
    unittest.main()

"""The unhappy-path harness itself (tests/unhappy.py) catches what it is meant to catch."""

import os
import signal
import time
import unittest

import torch

import kvops
from tests.unhappy import Case, cases_of, check_failing_call, classify, run_cases, run_isolated, source_modules


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


class TestRegistry(unittest.TestCase):
    """The report's classification (tests/unhappy.py: Case, classify, run_cases) and its sources."""

    def test_every_outcome(self):
        x = torch.zeros(3)

        def raise_(e):
            raise e

        def write_then_raise(y=torch.zeros(3)):
            y[0] = 1.0
            raise ValueError("x")

        cases = [
            Case("clear", lambda: (lambda: raise_(ValueError("x = 3 bad")), x), ValueError, ["x", "3"]),
            Case("unclear type", lambda: (lambda: raise_(IndexError("x = 3")), x), ValueError, ["x"]),
            Case("unclear needle", lambda: (lambda: raise_(ValueError("bad")), x), ValueError, ["x"]),
            Case("changed", lambda: (write_then_raise, write_then_raise.__defaults__), ValueError, ["x"]),
            Case("no error", lambda: (lambda: x, x), ValueError, ["x"]),
            Case("wrong result", lambda: (lambda: x + 1, x), None, check=lambda r: None if r.sum() == 0 else "off"),
            Case("right result", lambda: (lambda: x + 0, x), None, check=lambda r: None if r.sum() == 0 else "off"),
            Case("refused or right", lambda: (lambda: x + 0, x), ValueError, ["x"], check=lambda r: None),
            Case("crash", lambda: (lambda: os.kill(os.getpid(), signal.SIGSEGV), x), ValueError),
            Case("hang", lambda: (lambda: time.sleep(30), x), ValueError, timeout=1),
        ]
        got = {name: outcome for name, outcome, _ in run_cases(cases, timeout=20)}
        self.assertEqual(got, {"clear": "clear", "unclear type": "unclear", "unclear needle": "unclear",
                               "changed": "changed-on-failure", "no error": "silent-wrong",
                               "wrong result": "silent-wrong", "right result": "clear", "refused or right": "clear",
                               "crash": "crash", "hang": "hang"})
        self.assertEqual(classify(cases[0])[0], "clear")  # in-process too

    def test_sources(self):
        found = source_modules()
        self.assertEqual(found["ops"], "tests.unhappy_ops_cases")
        self.assertEqual(found["caches"], "tests.errors.test_unhappy_caches")
        caches = cases_of("tests.errors.test_unhappy_caches")  # the CASES-dict form, adapted
        self.assertGreater(len(caches), 100)
        call, state = caches[0].build()
        self.assertTrue(callable(call))


if __name__ == "__main__":
    unittest.main()

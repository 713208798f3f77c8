"""Deprecated names (docs/names.md) still work for one release, warn with their replacement, and do what it does;
the new names are the only ones kvops itself, its docs and its tests use."""

import pathlib
import re
import subprocess
import sys
import unittest
import warnings

import torch

import kvops
from kvops.cache import CausalKVCache, RingCausalKVCache
from kvops.packed import PackedCausalKVCache

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMES = (ROOT / "docs" / "names.md").read_text()


def one_warning(test, fn):
    """Run ``fn`` recording warnings; assert exactly one DeprecationWarning, raised at the caller's line; return
    (fn's result, the message)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    test.assertEqual(len(deprecations), 1, [str(w.message) for w in caught])
    test.assertEqual(deprecations[0].filename, __file__)  # points at the caller, not at kvops
    return out, str(deprecations[0].message)


class TestDeprecatedNames(unittest.TestCase):
    def test_reset_indices(self):
        for make in (lambda: CausalKVCache(torch.zeros(1, 4, 1, 2), torch.zeros(1, 4, 1, 2), sink_tokens=1),
                     lambda: RingCausalKVCache(torch.zeros(1, 4, 1, 2), torch.zeros(1, 4, 1, 2), sink_tokens=1),
                     lambda: PackedCausalKVCache(batch_size=1, cache_size=4, num_kv_heads=1, head_dim=2,
                                                 chunk_tokens=2, quant="int8", dtype=torch.float32)):
            cache = make()
            x = torch.ones(1, 2, 1, 2)
            cache.update_and_get_attention_kv(x, x, 0)
            self.assertEqual(cache.global_end, 2)
            with self.subTest(type(cache).__name__):
                _, msg = one_warning(self, cache.reset_indices)
                self.assertEqual(cache.global_end, 0)
                name = type(cache).__name__
                self.assertEqual(msg, f"{name}.reset_indices() is deprecated and will be removed in kvops 0.2; use "
                                      f"{name}.reset() (docs/names.md).")

    def test_paged_kv_gather_head_start(self):
        caches = [torch.arange(4 * 2 * 3 * 4, dtype=torch.float32).reshape(4, 2, 3, 4) + i for i in range(2)]
        table = torch.tensor([2, 0], dtype=torch.int32)
        new, old = torch.zeros(2, 1, 3, 2, 4), torch.zeros(2, 1, 3, 2, 4)
        kvops.paged_kv_gather(caches[:1], caches[1:], table, new, start=1, cache_head_start=1)
        _, msg = one_warning(self, lambda: kvops.paged_kv_gather(caches[:1], caches[1:], table, old, start=1,
                                                                 head_start=1))
        self.assertTrue(torch.equal(old, new))
        self.assertEqual(msg, "paged_kv_gather(head_start=...) is deprecated and will be removed in kvops 0.2; use "
                              "paged_kv_gather(cache_head_start=...) (docs/names.md).")
        with self.assertRaisesRegex(TypeError, r"got both cache_head_start= and its deprecated name head_start="):
            kvops.paged_kv_gather(caches[:1], caches[1:], table, old, 1, head_start=1, cache_head_start=1)

    def test_plan_for_writer(self):
        from kvops.transfer import plan_for_writer, routes_for_writer

        out, msg = one_warning(self, lambda: plan_for_writer(4, 2, 1, 8))
        self.assertEqual(out, routes_for_writer(4, 2, 1, 8))
        self.assertIn("kvops.transfer.plan_for_writer() is deprecated", msg)
        self.assertIn("use kvops.transfer.routes_for_writer()", msg)

    def test_transfer_plan_module(self):
        sys.modules.pop("kvops.transfer.plan", None)
        module, msg = one_warning(self, lambda: __import__("kvops.transfer.plan", fromlist=["plan"]))
        self.assertIn("the module kvops.transfer.plan is deprecated", msg)
        from kvops.transfer import routing

        for name in module.__all__:
            if name != "plan_for_writer":
                self.assertIs(getattr(module, name), getattr(routing, name))

    def test_default_filters_show_the_warning_in_user_code(self):
        """Python's default filter shows a DeprecationWarning raised in ``__main__``: the user's script sees it."""
        code = ("import torch, kvops\nc = kvops.CausalKVCache(torch.zeros(1, 2, 1, 1), torch.zeros(1, 2, 1, 1))\n"
                "c.reset_indices()\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        self.assertIn("DeprecationWarning: CausalKVCache.reset_indices() is deprecated", proc.stderr)


class TestNamesDoc(unittest.TestCase):
    def test_every_deprecated_name_is_documented(self):
        section = NAMES.split("## Deprecated names", 1)[1]
        for needle in ("reset_indices()", "head_start=h", "plan_for_writer", "kvops.transfer.plan`"):
            self.assertIn(needle, section)

    def test_deprecated_names_are_not_used(self):
        """kvops, its tests, examples, benchmarks and docs use the new names (only the aliases, this test and
        docs/names.md name the old ones)."""
        allowed = {"kvops/_deprecation.py", "kvops/transfer/plan.py", "kvops/transfer/__init__.py",
                   "kvops/cache/causal.py", "kvops/cache/packed.py", "kvops/ops/transfer.py", "tests/project/test_names.py",
                   "docs/names.md"}
        old = re.compile(r"\breset_indices\b|\bplan_for_writer\b|kvops\.transfer\.plan\b|"
                         r"paged_kv_gather\([^)]*[(, ]head_start=")
        files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, text=True).stdout.split()
        found = [f for f in files if f.endswith((".py", ".md")) and f not in allowed and (ROOT / f).exists()
                 and old.search((ROOT / f).read_text())]
        self.assertEqual(found, [])


if __name__ == "__main__":
    unittest.main()

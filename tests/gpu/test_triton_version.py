"""A Triton kernel that needs a newer Triton than the installed one says so when it is launched
(kvops/triton/launch.py): the oldest Triton every kernel compiles with is torch 2.11's 3.6 (docs/gpu.md)."""

import unittest

import expecttest
import torch

from kvops.triton import HAS_TRITON


@unittest.skipUnless(HAS_TRITON, "needs triton")
class TestTritonVersion(expecttest.TestCase):
    def test_installed_triton_is_new_enough_for_every_kernel(self):
        from kvops.triton import launch

        self.assertGreaterEqual(launch.triton_version(), launch.OLDEST_TRITON)
        self.assertEqual(launch.OLDEST_TRITON, (3, 6))

    def test_an_older_triton_is_named_at_call_time(self):
        from kvops.triton import launch
        from kvops.triton.paged_write import _paged_scatter_kernel

        with self.assertRaises(RuntimeError) as cm:
            launch.require_triton(_paged_scatter_kernel, installed=(3, 5))
        self.assertExpectedInline(str(cm.exception), """\
kvops: the Triton kernel _paged_scatter_kernel needs Triton >= 3.6, but Triton 3.5 is installed. Install a newer one (pip install 'triton>=3.6', or the torch build that pins it), or run the op on CPU tensors.""")
        launch.require_triton(_paged_scatter_kernel, installed=(3, 6))

    def test_a_kernel_listed_as_needing_a_newer_triton_refuses_before_launching(self):
        from kvops.triton import launch
        from kvops.triton.paged_write import _paged_scatter_kernel, plan_scatter_tokens

        key, cache = torch.ones(2, 1, 16), torch.zeros(2, 4, 1, 16)
        saved_checked = dict(launch._TRITON_CHECKED)
        launch.NEWER_TRITON["_paged_scatter_kernel"] = (99, 0)
        launch._TRITON_CHECKED.clear()
        try:
            (planned,) = plan_scatter_tokens(key, cache, torch.tensor([0, 5]), 0, None, (9, 0))
            with self.assertRaisesRegex(RuntimeError, r"_paged_scatter_kernel needs Triton >= 99\.0, but Triton 3\."):
                planned()
        finally:
            del launch.NEWER_TRITON["_paged_scatter_kernel"]
            launch._TRITON_CHECKED.clear()
            launch._TRITON_CHECKED.update(saved_checked)
        self.assertTrue(torch.equal(cache, torch.zeros(2, 4, 1, 16)))  # refused before anything ran


if __name__ == "__main__":
    unittest.main()

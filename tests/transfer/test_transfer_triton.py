"""Triton kernels of kvops.paged_kv_gather / paged_kv_scatter (all layers in one launch), bit-exact against the CPU
kernel and the per-token reference. Without CUDA they run in the Triton interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set by tests/conftest.py before kvops is imported; the ``setdefault`` below does the same
when this file runs on its own)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools  # noqa: E402
import unittest  # noqa: E402

import expecttest  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvops.ops.transfer import staging_shape  # noqa: E402
from kvops.cpu import transfer as cpu_kernel  # noqa: E402
from kvops.triton import transfer as triton_kernel  # noqa: E402
from tests.transfer.test_transfer_ops import FP8, bits, make_layers, ref_gather  # noqa: E402

INTERPRETED = isinstance(triton_kernel._staging_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"


class TestTransferTriton(expecttest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not INTERPRETED and not torch.cuda.is_available():
            raise RuntimeError(
                "kvops.triton was imported before TRITON_INTERPRET=1 was set and there is no GPU: run this file with "
                "TRITON_INTERPRET=1 (tests/conftest.py sets it) or in a fresh process."
            )

    def test_round_trip_matches_cpu_kernel(self):
        for dtype, layout in itertools.product((torch.float32, torch.bfloat16, FP8), ("separate", "joint_blocks")):
            with self.subTest(dtype=dtype, layout=layout):
                ks, vs = make_layers(2, 6, 4, 4, 8, dtype, layout, seed=7)
                table = torch.tensor([5, 0, 3], dtype=torch.int32)
                start, n, h0, h = 2, 9, 1, 2
                want = ref_gather(ks, vs, table, start, h0, n, h)
                to = lambda ts: [t.to(DEVICE) for t in ts]  # noqa: E731
                gks, gvs = to(ks), to(vs)
                staging = torch.empty(staging_shape(2, n, h, 8), dtype=dtype, device=DEVICE)
                triton_kernel.paged_kv_gather(gks + gvs, table.to(DEVICE), start, h0, staging)
                self.assertTrue(torch.equal(bits(staging.cpu()), bits(want)))
                # scatter at another table and head start; the CPU kernel on copies of the same caches agrees
                dst = torch.tensor([1, 4, 2], dtype=torch.int64)
                dks, dvs = make_layers(2, 6, 4, 4, 8, dtype, layout, seed=8)
                cks, cvs = [c.clone() for c in dks], [c.clone() for c in dvs]
                gdks, gdvs = to(dks), to(dvs)
                cpu_kernel.paged_kv_scatter(want, cks + cvs, dst, start, 2)
                triton_kernel.paged_kv_scatter(staging, gdks + gdvs, dst.to(DEVICE), start, 2)
                for got, ref in zip(gdks + gdvs, cks + cvs):
                    self.assertTrue(torch.equal(bits(got.cpu()), bits(ref)))

    def test_head_dim_80_block_size_1(self):
        ks, vs = make_layers(1, 5, 1, 5, 80, torch.float16, "separate", seed=9)
        table = torch.tensor([3, 1, 4, 0], dtype=torch.int32)
        staging = torch.empty(staging_shape(1, 3, 3, 80), dtype=torch.float16, device=DEVICE)
        triton_kernel.paged_kv_gather([ks[0].to(DEVICE), vs[0].to(DEVICE)], table.to(DEVICE), 1, 2, staging)
        self.assertTrue(torch.equal(staging.cpu(), ref_gather(ks, vs, table, 1, 2, 3, 3)))


if __name__ == "__main__":
    unittest.main()

"""FlashInfer's batch-decode test grid through ``kvops.integrations.flashinfer.BatchDecodeWithPagedKVCacheWrapper``.

Written from FlashInfer's public ``tests/test_batch_decode_kernels.py`` (``test_batch_decode_with_paged_kv_cache`` and
``..._with_tuple_paged_kv_cache``): batch 12/17, kv_len 54/97/512, page size 1/8/16, 4 KV heads with 4 or 32 query
heads, head_dim 128/256, HND/NHD, ``pos_encoding_mode`` NONE/ROPE_LLAMA/ALIBI, ``logits_soft_cap`` 0/30,
``run_return_lse`` or ``run``, fp16 queries, fp16 or fp8 (e4m3) caches, contiguous or strided (every other element
of an interleaved allocation), one ``[P, 2, ...]`` tensor or a ``(k, v)`` tuple, ``plan(...)`` with
``data_type=``/``q_data_type=`` as FlashInfer's test passes them; a seeded sample, against a plain fp64 decode with
FlashInfer's semantics (tests/integrations/test_flashinfer_decode.py). FlashInfer's grid also has ``float8_e5m2`` caches, which
kvops does not store (its fp8 caches are ``float8_e4m3fn``): that kv dtype is left out here, and
``kvops.paged_attention`` refuses it with a ValueError that names the supported dtypes.
"""

from __future__ import annotations

import unittest

import torch

from kvops.integrations.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from tests.compat._oracle import sample
from tests.integrations.test_flashinfer_decode import gather, make_case, reference_decode

GRID = dict(
    batch_size=[12, 17], kv_len=[54, 97, 512], page_size=[1, 8, 16], num_qo_heads=[4, 32], head_dim=[128, 256],
    kv_layout=["HND", "NHD"], pos_encoding_mode=["NONE", "ROPE_LLAMA", "ALIBI"], logits_soft_cap=[0.0, 30.0],
    return_lse=[True, False], kv_dtype=[torch.float16, torch.float8_e4m3fn], contiguous_kv=[True, False],
    tuple_cache=[False, True],
)


class TestBatchDecodeGrid(unittest.TestCase):
    @classmethod
    def setUpClass(cls):  # many tiny reference ops: threads only add contention on a shared machine
        cls.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    @classmethod
    def tearDownClass(cls):
        torch.set_num_threads(cls.threads)

    def test_sampled_grid(self):
        for i, c in enumerate(sample(GRID, 10, seed=33)):
            with self.subTest(case=c):
                self.check(c, seed=i)

    def check(self, c, seed):
        batch, kv_len, page, h_q, d = c["batch_size"], c["kv_len"], c["page_size"], c["num_qo_heads"], c["head_dim"]
        layout, mode, cap, kv_dtype = c["kv_layout"], c["pos_encoding_mode"], c["logits_soft_cap"], c["kv_dtype"]
        q, kv, indptr, indices, last = make_case(batch, [kv_len] * batch, page, h_q, 4, d, layout, kv_dtype,
                                                 torch.float16, c["contiguous_kv"], seed)
        wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 * 1024 * 1024, dtype=torch.int8), layout)
        wrapper.plan(indptr, indices, last, h_q, 4, d, page, logits_soft_cap=cap, pos_encoding_mode=mode,
                     data_type=kv_dtype, q_data_type=torch.float16)
        cache = (kv[:, 0], kv[:, 1]) if c["tuple_cache"] else kv
        o = wrapper.run_return_lse(q, cache)[0] if c["return_lse"] else wrapper.run(q, cache)
        for b in range(batch):
            k = gather(kv, indptr, indices, kv_len, b, layout, 0)
            v = gather(kv, indptr, indices, kv_len, b, layout, 1)
            ref, _ = reference_decode(q[b], k, v, mode, -1, cap, d ** -0.5)
            torch.testing.assert_close(o[b].double(), ref, rtol=1e-3, atol=1e-3)  # FlashInfer's tolerance

    def test_e5m2_caches_are_refused_clearly(self):
        q, kv, indptr, indices, last = make_case(2, [9, 9], 8, 4, 4, 64, "NHD", torch.float8_e5m2, torch.float16,
                                                 True, 0)
        wrapper = BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
        wrapper.plan(indptr, indices, last, 4, 4, 64, 8, data_type=torch.float8_e5m2, q_data_type=torch.float16)
        with self.assertRaisesRegex(ValueError, r"k_cache dtype torch.float8_e5m2 .* or be torch.float8_e4m3fn"):
            wrapper.run(q, kv)


if __name__ == "__main__":
    unittest.main()

"""packed_attention: segment-wise attention merged by LSE equals attention over the dequantized window."""

from __future__ import annotations

import unittest

import torch

from kvops.cache import PackedCausalKVCache
from kvops.packed import materialize, packed_attention


def reference(q, k, v, scale=None):
    """fp64 softmax attention, query head h reading KV head h // (H_q / H_kv): (out, LSE [B, H_q, T])."""
    group = q.shape[2] // k.shape[2]
    k, v = k.double().repeat_interleave(group, 2), v.double().repeat_interleave(group, 2)
    s = torch.einsum("bthd,bshd->bhts", q.double(), k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1), v), s.logsumexp(-1)


def streamed_view(quant, heads, dim, dtype, chunks=6, **kwargs):
    c = PackedCausalKVCache.allocate(2, 16, heads, dim, chunk_tokens=3, quant=quant, keep_recent_chunks=1,
                                     sink_tokens=2, dtype=dtype, **kwargs)
    g = torch.Generator().manual_seed(0)
    for i in range(chunks):
        x = torch.randn(2, 3, heads, dim, generator=g).to(dtype)
        view = c.update(x, x * 0.5 + 1, 3 * i)
    return view


class TestPackedAttention(unittest.TestCase):
    def test_matches_attention_over_the_dequantized_window(self):
        cases = [("int8", 2, 10, 64), ("fp8", 1, 7, 64), ("int4", 2, 2, 80), ("int2", 1, 5, 64), (None, 3, 3, 32)]
        for quant, hkv, hq, dim in cases:  # GQA 5:1, 7:1, 1:1; head_dim 80
            for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
                view = streamed_view(quant, hkv, dim, dtype, group_size=dim if dim == 80 else None)
                self.assertGreater(len(view.k), 2)  # sink, packed chunks, dense chunks
                q = torch.randn(2, 3, hq, dim).to(dtype)
                out, lse = packed_attention(q, view.k, view.v, return_lse=True, scale=0.1)
                want, want_lse = reference(q, materialize(view.k, torch.float32), materialize(view.v, torch.float32),
                                           scale=0.1)
                self.assertEqual(out.dtype, dtype)
                torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
                torch.testing.assert_close(lse.double(), want_lse, rtol=tol, atol=tol)

    def test_one_dense_segment(self):
        view = streamed_view("int8", 2, 32, torch.float32, chunks=1)
        self.assertEqual(len(view.k), 1)
        q = torch.randn(2, 3, 4, 32)
        torch.testing.assert_close(packed_attention(q, view.k, view.v).double(),
                                   reference(q, view.k[0], view.v[0])[0], rtol=1e-5, atol=1e-5)

    def test_errors(self):
        view = streamed_view("int8", 2, 32, torch.float32)
        with self.assertRaisesRegex(ValueError, r"query heads \(3\) must be a multiple of num_kv_heads \(2\)"):
            packed_attention(torch.randn(2, 3, 3, 32), view.k, view.v)
        with self.assertRaisesRegex(ValueError, "same non-zero number of K and V segments"):
            packed_attention(torch.randn(2, 3, 2, 32), [], [])


if __name__ == "__main__":
    unittest.main()

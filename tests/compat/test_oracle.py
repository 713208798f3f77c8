"""The compatibility suite's dense oracle (tests/compat/_oracle.py) is kvops' oracle: it agrees with the per-query
reference kvops/reference/attention.py on every feature the suite uses (causal, windows, softcap, ALiBi, left
padding, GQA, fp8 scales), so the peers' grids are checked against kvops' semantics."""

from __future__ import annotations

import unittest

import torch

from kvops.reference.attention import reference
from tests.compat._oracle import attend


class TestDenseOracle(unittest.TestCase):
    def test_matches_the_reference(self):
        g = torch.Generator().manual_seed(0)
        b, s_q, s, h_q, h_kv, d = 3, 4, 13, 6, 2, 8
        q = torch.randn(b, s_q, h_q, d, generator=g)
        k, v = torch.randn(b, s, h_kv, d, generator=g), torch.randn(b, s, h_kv, d, generator=g)
        lens = torch.tensor([13, 4, 9], dtype=torch.int32)
        table = torch.arange(b, dtype=torch.int32).view(b, 1)  # sequence b is block b of block_size S
        cu = torch.arange(b + 1, dtype=torch.int32) * s_q
        cases = [dict(causal=True), dict(causal=False), dict(causal=True, window_left=3),
                 dict(causal=False, window_left=2, window_right=1), dict(causal=True, softcap=2.0),
                 dict(causal=True, alibi_slopes=torch.rand(b, h_q, generator=g)),
                 dict(causal=False, cache_leftpad=torch.tensor([2, 0, 5], dtype=torch.int32)),
                 dict(causal=True, k_scale=torch.tensor([0.5, 2.0]), v_scale=torch.tensor([0.25, 1.0]))]
        for kw in cases:
            with self.subTest(kw=kw):
                want_out, want_lse = reference(q.flatten(0, 1), k, v, cu, lens, table, **kw)
                got_out, got_lse = attend(q, k, v, lens, causal=kw["causal"],
                                          window=(kw.get("window_left", -1), kw.get("window_right", -1)),
                                          softcap=kw.get("softcap", 0.0), alibi=kw.get("alibi_slopes"),
                                          leftpad=kw.get("cache_leftpad"), k_scale=kw.get("k_scale"),
                                          v_scale=kw.get("v_scale"))
                torch.testing.assert_close(got_out.flatten(0, 1), want_out, atol=1e-12, rtol=1e-12)
                torch.testing.assert_close(got_lse.permute(1, 0, 2).flatten(1), want_lse, atol=1e-12, rtol=1e-12)


if __name__ == "__main__":
    unittest.main()

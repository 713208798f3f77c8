"""Property test of the MLA ops (hypothesis, derandomized, bounded): random geometries (kv_lora_rank, rope_dim,
block_size, heads), varlen batches mixing decode, chunked prefill, empty sequences and sequences with more queries
than rows, causal or not, every cache dtype; the write is bit-exact against the fp64 oracle, attention within the
dtype's tolerance, and NaN in every unused slot never reaches the output."""

import unittest

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvops
from kvops.reference import mla as ref
from tests.mla._cases import FP8, filled_cache

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@st.composite
def cases(draw):
    b = draw(st.integers(1, 4))
    seq_lens = draw(st.lists(st.integers(0, 40), min_size=b, max_size=b))
    q_lens = [draw(st.integers(0, max(1, s + 2))) if s else draw(st.integers(0, 1)) for s in seq_lens]
    return dict(seq_lens=seq_lens, q_lens=q_lens, rank=draw(st.sampled_from([8, 32, 40])),
                rope=draw(st.sampled_from([0, 16, 24])), block_size=draw(st.sampled_from([1, 3, 16])),
                heads=draw(st.sampled_from([1, 4, 5])), causal=draw(st.booleans()),
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])), fp8=draw(st.booleans()),
                seed=draw(st.integers(0, 1000)))


class TestMLAFuzz(unittest.TestCase):
    @settings(derandomize=True, max_examples=40, deadline=None, database=None)
    @given(cases())
    def test_write_and_attention_match_the_oracle(self, c):
        scale = torch.tensor(0.05) if c["fp8"] else None
        kv_cache, cu, lens, table = filled_cache(c["seq_lens"], c["q_lens"], c["block_size"], c["rank"], c["rope"],
                                                 c["dtype"], seed=c["seed"], kv_scale=scale)
        g = torch.Generator().manual_seed(c["seed"])
        q = torch.randn(int(cu[-1]), c["heads"], c["rank"] + c["rope"], generator=g).to(c["dtype"])
        out, lse = kvops.mla_attention(q, kv_cache, cu, lens, table, max(c["q_lens"] + [1]), c["rank"],
                                       causal=c["causal"], kv_scale=scale)
        want, want_lse = ref.mla_attention(q, kv_cache, cu, lens, table, c["rank"], causal=c["causal"],
                                           kv_scale=scale)
        tol = TOL[c["dtype"]]
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.double(), want_lse, rtol=tol, atol=tol)
        # the write: a second batch over the same cache, bit-exact (negative slots skipped)
        num_slots = kv_cache.shape[0] * kv_cache.shape[1]
        n = min(5, num_slots)
        drop = torch.rand(n, generator=g) < 0.3
        slots = torch.where(drop, -1, torch.randperm(num_slots, generator=g)[:n])  # distinct, some skipped
        src = c["dtype"]
        kv_c = torch.randn(n, c["rank"], generator=g).to(src)
        k_pe = torch.randn(n, c["rope"], generator=g).to(src)
        want_cache = ref.mla_cache_write(kv_c, k_pe, kv_cache, slots, scale)
        kvops.mla_cache_write(kv_c, k_pe, kv_cache, slots, kv_scale=scale)
        self.assertTrue(torch.equal(kv_cache.view(torch.uint8), want_cache.view(torch.uint8)))
        self.assertEqual(kv_cache.dtype, FP8 if c["fp8"] else c["dtype"])


if __name__ == "__main__":
    unittest.main()

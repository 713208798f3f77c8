"""A cache built with the wrong KV head count (4 heads for a model with 2): every path says the likely fix first.

The trap: the write's error offered ``cache_head_start`` first (a head slice, for tensor-parallel writers filling one
cache), and taking it wrote heads [0, 2) of 4, after which attention with the model's 4 query heads read KV heads 2
and 3, never written: no error, output off by up to 4.9. Now the messages lead with the cache's head count, and
``PagedKVCache.attention`` refuses a layer whose head-sliced writes left heads unwritten. Where nothing can tell the
mistake from a head-sliced writer (the raw ops with ``H_q`` a multiple of the cache's heads), the write's message is
what steers.
"""

import unittest

import expecttest
import torch
import torch._dynamo

import kvops
from kvops.cache import PagedKVCache
from kvops.integrations.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from tests.contract import raises_everywhere

PY_ERROR = torch._dynamo.exc.Unsupported  # PagedKVCache's checks run in Python, traced by Dynamo
H_Q, H_KV, D, BS = 4, 2, 16, 4  # the model: GQA 2:1


def sdpa_reference(q, k, v):
    """Causal attention of one sequence ``q [T, H_q, D]`` over ``k``/``v`` ``[T, H_kv, D]`` (GQA by repeat)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           is_causal=True)
    return out.transpose(0, 1)


class TestWrongKVHeads(expecttest.TestCase):
    def setUp(self):
        torch.manual_seed(0)
        self.q, self.k, self.v = torch.randn(5, H_Q, D), torch.randn(5, H_KV, D), torch.randn(5, H_KV, D)

    def paged(self, num_kv_heads):
        cache = PagedKVCache(8, BS, num_kv_heads, D, dtype=torch.float32)
        cache.add_sequence(0)
        return cache, cache.prepare({0: 5})

    def test_write_op_leads_with_the_caches_head_count(self):
        cache, step = self.paged(4)
        msg = raises_everywhere(self, ValueError, lambda k, v, kc, vc, s: kvops.paged_cache_write(k, v, kc, vc, s),
                                (self.k, self.v, cache.k_caches[0], cache.v_caches[0], step.slot_mapping))
        self.assertExpectedInline(msg, """kvops.paged_cache_write requires cache_head_start when cache heads (4) differ from input heads (2). If the model has 2 KV heads, allocate the cache with 2 KV heads (num_kv_heads=2). A head slice is for several writers filling one cache (tensor-parallel writers): then pass cache_head_start (0 <= cache_head_start <= 2) to write the input heads as heads [cache_head_start, cache_head_start + 2), and have the other writers fill the other heads before attention. Or pass key/value with all 4 heads.""")  # noqa: B950
        self.assertLess(msg.index("num_kv_heads=2"), msg.index("pass cache_head_start"))

    def test_paged_kv_cache_write_leads_with_num_kv_heads(self):
        cache, step = self.paged(4)
        msg = raises_everywhere(self, ValueError, lambda k, v: cache.write(0, k, v, step), (self.k, self.v),
                                compile_exc=PY_ERROR)
        self.assertExpectedInline(msg, """PagedKVCache.write: key of shape (5, 2, 16) has 2 heads, which differ from the cache's num_kv_heads=4. If the model has 2 KV heads, build PagedKVCache with num_kv_heads=2. A head slice is for several writers filling one cache (tensor-parallel writers): then pass cache_head_start (0 <= cache_head_start <= 2), and have the other writers fill the other heads before attention.""")  # noqa: B950

    def test_sliced_write_then_attention_refused(self):
        """Before: no error, and the output differed from the model's reference by up to several units."""
        cache, step = self.paged(4)
        cache.write(0, self.k, self.v, step, cache_head_start=0)  # the trap: the advice the old message led with
        msg = raises_everywhere(self, ValueError, lambda q: cache.attention(0, q, step), (self.q,),
                                compile_exc=PY_ERROR)
        self.assertExpectedInline(msg, """PagedKVCache.attention: layer 0's cache has num_kv_heads=4, but its writes filled only heads [0, 2) (PagedKVCache.write with cache_head_start), so q's 4 heads would read heads that were never written. If the model has 2 KV heads, build PagedKVCache with num_kv_heads=2 and write without cache_head_start; with head-sliced writers, write every head slice before attention.""")  # noqa: B950

    def test_sliced_write_and_attention_in_one_compiled_step(self):
        cache, step = self.paged(4)

        def layer(q, k, v, cache, step):
            cache.write(0, k, v, step, cache_head_start=0)
            return cache.attention(0, q, step)

        with self.assertRaisesRegex(ValueError, "filled only heads"):
            layer(self.q, self.k, self.v, cache, step)
        torch._dynamo.reset()
        cache, step = self.paged(4)
        with self.assertRaisesRegex(PY_ERROR, "filled only heads"):
            torch.compile(layer, fullgraph=True, backend="eager")(self.q, self.k, self.v, cache, step)

    def test_head_sliced_writers_that_fill_every_head(self):
        """Two writers, heads [0, 2) and [2, 4), of a cache with 4 heads: attention reads them all (GQA 1:1)."""
        cache, step = self.paged(4)
        k2, v2 = torch.randn(5, H_KV, D), torch.randn(5, H_KV, D)
        cache.write(0, self.k, self.v, step, cache_head_start=0)
        cache.write(0, k2, v2, step, cache_head_start=2)
        out = cache.attention(0, self.q, step)
        want = sdpa_reference(self.q, torch.cat([self.k, k2], 1), torch.cat([self.v, v2], 1))
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)

    def test_the_leading_fix_gives_the_models_attention(self):
        cache, step = self.paged(H_KV)
        cache.write(0, self.k, self.v, step)
        torch.testing.assert_close(cache.attention(0, self.q, step), sdpa_reference(self.q, self.k, self.v),
                                   atol=1e-5, rtol=1e-5)

    def test_attention_op_heads_not_a_multiple(self):
        """A model with 6 query heads over 2 KV heads (GQA 3:1) and a cache built with 4."""
        cache, step = self.paged(4)
        q = torch.randn(5, 6, D)
        msg = raises_everywhere(self, ValueError, lambda q, kc, vc, cu, sl, bt: kvops.paged_attention(
            q, kc, vc, cu, sl, bt, max_seqlen_q=5), (q, cache.k_caches[0], cache.v_caches[0], step.cu_seqlens_q,
                                                     step.seq_lens, step.block_table))
        self.assertExpectedInline(msg, """kvops.paged_attention: num_heads (6) must be a multiple of num_kv_heads (4) (GQA: query head h reads KV head h // (num_heads // num_kv_heads)). If the cache was allocated with another head count than the model's, allocate it with the model's num_kv_heads (a divisor of 6); else pass q with a multiple of 4 heads.""")  # noqa: B950
        msg = raises_everywhere(self, ValueError, lambda q: cache.attention(0, q, step), (q,), compile_exc=PY_ERROR)
        self.assertExpectedInline(msg, """PagedKVCache.attention: q of shape (5, 6, 16) has 6 heads, which must be a multiple of the cache's num_kv_heads=4 (GQA). If the model has another KV head count, build PagedKVCache with it (a divisor of 6); else pass q with a multiple of 4 heads.""")  # noqa: B950

    def test_flash_attn_with_kvcache_new_keys(self):
        k_cache, v_cache = torch.zeros(2, 8, 4, D), torch.zeros(2, 8, 4, D)
        q, k = torch.randn(2, 1, H_Q, D), torch.randn(2, 1, H_KV, D)
        msg = raises_everywhere(self, ValueError, lambda q, kc, vc, k: kvops.flash_attn_with_kvcache(
            q, kc, vc, k, k, cache_seqlens=3), (q, k_cache, v_cache, k), compile_exc=PY_ERROR)
        self.assertExpectedInline(msg, """flash_attn_with_kvcache: k must be [batch=2, seqlen_new, num_kv_heads=4, head_dim=16] (k and v with the same seqlen_new), got shape (2, 1, 2, 16). If the model has 2 KV heads, allocate k_cache and v_cache with 2 heads.""")  # noqa: B950

    def test_flashinfer_wrapper_cache_heads_against_the_plan(self):
        wrapper = BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
        wrapper.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                     torch.tensor([3], dtype=torch.int32), H_Q, H_KV, D, BS, q_data_type=torch.float32)
        kv = torch.zeros(2, 2, BS, 4, D)  # [P, 2, page_size, H_kv, D] with 4 heads
        with self.assertRaises(ValueError) as cm:
            wrapper.run(torch.randn(1, H_Q, D), kv)
        self.assertExpectedInline(str(cm.exception), """BatchDecodeWithPagedKVCacheWrapper.run: k_cache [2, 4, 4, 16] is not NHD [P, page_size, H_kv, D] with page_size 4 and 2 KV heads as planned. Allocate the cache with the planned num_kv_heads=2 (the model's), or plan with num_kv_heads=4.""")  # noqa: B950


if __name__ == "__main__":
    unittest.main()

"""Every dtype/shape error on an index tensor (slot_mapping, block_table, seq_lens, cu_seqlens_q, cache_seqlens,
cache_leftpad, cache_batch_idx, positions, start, cursors, indptr, ...) ends with a fix line, as a bad block_table
always did ("Pass block_table.to(torch.int32)."), and a contiguous write past the end names the values and a fix.

One sweep calls every op with each bad index argument (eager, compile, export where the call can be traced) and checks
that the message ends with a "Pass ..."/"Reshape ..." sentence; the messages not covered by the ops' own test files are
pinned with ``assertExpectedInline``.
"""

import re
import unittest

import expecttest
import torch
import torch._dynamo

import kvops
from kvops.cache import PagedKVCache
from kvops.export import init_cursors, streaming_update
from kvops.integrations.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from tests.contract import raises_everywhere

ANY_DYNAMO = (torch._dynamo.exc.TorchRuntimeError, torch._dynamo.exc.Unsupported)  # fake rule or traced Python
FIX = re.compile(r"(Pass|Reshape|pass) [^.]*(\.[^ .][^.]*)*\.\)?$")
I32, I64 = torch.int32, torch.int64


def _paged():
    cache = PagedKVCache(8, 4, 2, 16, dtype=torch.float32)
    cache.add_sequence(0)
    cache.add_sequence(1)
    return cache, cache.prepare({0: 3, 1: 2})


def cases():
    """``(name, fn, args)``: each call raises a ValueError on one index argument."""
    cache, step = _paged()
    kc, vc = cache.k_caches[0], cache.v_caches[0]
    k, q = torch.randn(5, 2, 16), torch.randn(5, 4, 16)
    cos, sin = torch.randn(32, 8), torch.randn(32, 8)
    att = lambda q, kc, vc, cu, sl, bt, **kw: kvops.paged_attention(q, kc, vc, cu, sl, bt, max_seqlen_q=3, **kw)  # noqa
    yield "slot_mapping float", lambda k, s: kvops.paged_cache_write(k, k, kc, vc, s), (k, step.slot_mapping.float())
    yield "slot_mapping 2-D", lambda k, s: kvops.paged_cache_write(k, k, kc, vc, s), (k, step.slot_mapping[None])
    yield "rotary positions float", lambda k, s, p: kvops.rotary_paged_cache_write(k, k, kc, vc, s, p, cos, sin), (
        k, step.slot_mapping, step.positions.float())
    for name, i in (("cu_seqlens_q", 3), ("seq_lens", 4), ("block_table", 5)):
        for how, bad in (("int64", lambda t: t.long()), ("float, other rank", lambda t: t.float()[None])):
            args = [q, kc, vc, step.cu_seqlens_q, step.seq_lens, step.block_table]
            args[i] = bad(args[i])
            yield f"{name} {how}", att, tuple(args)
    yield "cache_leftpad int64", lambda q, lp: att(q, kc, vc, step.cu_seqlens_q, step.seq_lens, step.block_table,
                                                   cache_leftpad=lp), (q, torch.zeros(2, dtype=I64))
    q4, k4 = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16)
    fa = kvops.flash_attn_with_kvcache
    yield "flash block_table 1-D", lambda q, bt: fa(q, kc, vc, cache_seqlens=1, block_table=bt), (
        q4, step.block_table[0])
    yield "flash cache_seqlens int64", lambda q, k, s: fa(q, kc, vc, k, k, cache_seqlens=s, block_table=step.block_table), (
        q4, k4, torch.ones(2, dtype=I64))
    ck = torch.zeros(3, 8, 2, 16)
    yield "flash cache_batch_idx 2-D", lambda q, i: fa(q, ck, ck, cache_seqlens=1, cache_batch_idx=i), (
        q4, torch.zeros(1, 2, dtype=I32))
    yield "flash cache_leftpad float", lambda q, lp: fa(q, ck[:2], ck[:2], cache_seqlens=1, cache_leftpad=lp), (
        q4, torch.zeros(2))
    staging = torch.zeros(2, 1, 3, 2, 16)
    yield "transfer block_table float", lambda bt: kvops.paged_kv_gather([kc], [vc], bt, staging, 0), (
        step.block_table[0].float(),)
    yield "step_at positions float", lambda p: cache.step_at(p, step.block_table).slot_mapping, (torch.tensor([1.0]),)
    yield "step_at positions 3-D", lambda p: cache.step_at(p, step.block_table).slot_mapping, (
        torch.zeros(1, 1, 1, dtype=I64),)
    yield "step_at block_table int64", lambda t: cache.step_at(torch.tensor([1]), t).slot_mapping, (
        step.block_table.long(),)
    cc = torch.zeros(2, 8, 2, 16)
    yield "cache_write start float", lambda s: kvops.cache_write(k4, k4, cc, cc.clone(), s), (torch.tensor(1.0),)
    yield "cache_roll src 2-D", lambda s: kvops.cache_roll(cc, cc.clone(), s, 0, 1), (torch.zeros(1, 1, dtype=I64),)
    yield "apply_rotary positions", lambda x, p: kvops.apply_rotary(x, cos, sin, p), (
        torch.randn(2, 3, 4, 16), torch.arange(3).float())
    yield "apply_rotary positions shape", lambda x, p: kvops.apply_rotary(x, cos, sin, p), (
        torch.randn(2, 3, 4, 16), torch.arange(3))
    sk = torch.zeros(1, 8, 2, 16)
    yield "streaming cursors int32", lambda c: streaming_update(k4[:1], k4[:1], sk, sk.clone(), c,
                                                                 torch.tensor(0)), (init_cursors().int(),)


class TestEveryIndexErrorHasAFix(expecttest.TestCase):
    def test_sweep(self):
        for name, fn, args in cases():
            with self.subTest(name):
                torch._dynamo.reset()
                msg = raises_everywhere(self, ValueError, fn, args, compile_exc=ANY_DYNAMO)
                self.assertRegex(msg, FIX, name)

    def test_new_messages(self):
        msgs = {name: raises_everywhere(self, ValueError, fn, args, compile_exc=ANY_DYNAMO)
                for name, fn, args in cases() if name in ("seq_lens float, other rank", "flash block_table 1-D",
                                                          "step_at positions 3-D", "apply_rotary positions shape",
                                                          "streaming cursors int32", "flash cache_batch_idx 2-D")}
        self.assertExpectedInline(msgs["seq_lens float, other rank"], """kvops.paged_attention: seq_lens must be a 1-D int32 tensor [batch], got shape (1, 2) and dtype torch.float32. Pass seq_lens.to(torch.int32) (built with integer ops: // rather than /), and reshape it to [batch].""")  # noqa: B950
        self.assertExpectedInline(msgs["flash block_table 1-D"], """flash_attn_with_kvcache: block_table must be a 2-D int32 tensor [batch, max_blocks], got shape (1,) and dtype torch.int32. Reshape block_table to [batch, max_blocks].""")  # noqa: B950
        self.assertExpectedInline(msgs["step_at positions 3-D"], """PagedKVCache.step_at: positions must be an int32/int64 tensor [num_new_tokens] (shared by every sequence, as gpt-fast's input_pos) or [batch, num_new_tokens] with at least one token, got shape (1, 1, 1) and dtype torch.int64. Each sequence's positions are its new tokens' positions, consecutive (a prefill chunk arange(s, s + T), a decode step [s]). Pass positions with the shape [num_new_tokens].""")  # noqa: B950
        self.assertExpectedInline(msgs["apply_rotary positions shape"], """kvops.apply_rotary: positions must have shape x.shape[:-2] = (2, 3) (one position per token), got (3,). Pass positions.expand([2, 3]) (the same positions for every sequence).""")  # noqa: B950
        self.assertExpectedInline(msgs["streaming cursors int32"], """kvops.export.streaming_update: cursors must be int64 [2] (global_end, local_end) and current_chunk_start an int64 0-d tensor, got torch.int32 (2,) and torch.int64 (). Pass the cursors the previous step returned (kvops.export.init_cursors(device) for a new stream) and current_chunk_start=torch.tensor(start, dtype=torch.int64, device=device).""")  # noqa: B950
        self.assertExpectedInline(msgs["flash cache_batch_idx 2-D"], """flash_attn_with_kvcache: cache_batch_idx must be an int32 tensor of shape [2] (the k_cache row of each sequence), got shape (1, 2) and dtype torch.int32. Reshape cache_batch_idx to [2] (one row per sequence).""")  # noqa: B950

    def test_eager_only_helpers(self):
        """Host-side entry points (FlashInfer's plan, the debug checks): eager calls only."""
        cache, step = _paged()
        with self.assertRaises(ValueError) as cm:
            kvops.check_slot_mapping(step.slot_mapping.float(), cache.k_caches[0])
        self.assertExpectedInline(str(cm.exception), """kvops.check_slot_mapping: slot_mapping must be a 1-D int32 or int64 tensor [num_tokens], got shape (5,) and dtype torch.float32. Pass slot_mapping.to(torch.int64) (built with integer ops: // rather than /).""")  # noqa: B950
        with self.assertRaises(ValueError) as cm:
            kvops.check_kvcache_capacity(cache.k_caches[0], torch.tensor([1, 1]), step.block_table)
        self.assertExpectedInline(str(cm.exception), """kvops.check_kvcache_capacity: cache_seqlens must be an int32 tensor [batch], got shape (2,) and dtype torch.int64. Pass cache_seqlens.to(torch.int32).""")  # noqa: B950
        wrapper = BatchDecodeWithPagedKVCacheWrapper()
        for name, bad in (("indices", torch.tensor([0, 1])), ("last_page_len", torch.tensor([[2]], dtype=I32))):
            args = dict(indptr=torch.tensor([0, 2], dtype=I32), indices=torch.tensor([0, 1], dtype=I32),
                        last_page_len=torch.tensor([2], dtype=I32))
            args[name] = bad
            with self.assertRaises(ValueError) as cm:
                wrapper.plan(args["indptr"], args["indices"], args["last_page_len"], 4, 2, 16, 4)
            self.assertRegex(str(cm.exception), FIX)
        self.assertExpectedInline(str(cm.exception), """BatchDecodeWithPagedKVCacheWrapper.plan: last_page_len must be a 1-D int32 tensor, got ((1, 1), torch.int32). Reshape last_page_len to [batch].""")  # noqa: B950
        wrapper.plan(torch.tensor([0, 2], dtype=I32), torch.tensor([0, 1], dtype=I32), torch.tensor([2], dtype=I32),
                     4, 2, 16, 4, q_data_type=torch.float32)
        with self.assertRaises(ValueError) as cm:
            wrapper.run(torch.randn(1, 4, 16), (torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16)))
        self.assertExpectedInline(str(cm.exception), """BatchDecodeWithPagedKVCacheWrapper.run: k_cache [2, 8, 2, 16] is not NHD [P, page_size, H_kv, D] with page_size 4 and 2 KV heads as planned. Allocate the cache with the planned page_size=4, or plan with page_size=8.""")  # noqa: B950

    def test_contiguous_write_past_the_end_with_a_tensor_start(self):
        """The value check of a tensor ``start`` (eager calls) gives the int form's message, fix included."""
        kc, vc = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 2, 16)
        with self.assertRaises(RuntimeError) as cm:
            kvops.cache_write(torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16), kc, vc, torch.tensor([7]))
        self.assertExpectedInline(str(cm.exception), """Invalid kvops.cache_write write range: local=[7, 10), kv_cache_size=8, num_new_tokens=3. Rows must satisfy 0 <= start and start + num_new_tokens <= kv_cache_size. Pass start <= 5 (kv_cache_size - num_new_tokens), write at most 1 token at start=7, or allocate a cache of at least 10 rows (kvops.CausalKVCache evicts old rows when its cache is full).""")  # noqa: B950
        self.assertFalse(kc.any() or vc.any())


if __name__ == "__main__":
    unittest.main()

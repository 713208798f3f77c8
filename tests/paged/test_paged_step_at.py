"""``PagedKVCache.step_at``: the step's metadata built on the device from a tensor of positions and a block table
(compiled generate loops, gpt-fast's ``input_pos``): the same tensors as the host-side ``prepare``, one compiled graph
as positions advance, the positions checked per the value-check mode, contracts in eager, compile and export."""

from __future__ import annotations

import unittest

import expecttest
import torch
from torch._dynamo.testing import CompileCounter

import kvops
from kvops.cache import PagedKVCache
from tests.contract import _Wrap, raises_everywhere

PY_ERROR = torch._dynamo.exc.Unsupported  # the cache's checks run in Python (traced)


def reserved(batch=2, tokens=12, block_size=4, num_blocks=16):
    """A cache whose sequences have blocks for ``tokens`` tokens reserved, interleaved (ids not in order)."""
    cache = PagedKVCache(num_blocks, block_size, 2, 8, dtype=torch.float32)
    for b in range(batch):
        cache.add_sequence(b)
    for _ in range(-(-tokens // block_size)):
        for b in range(batch):
            cache.extend(b, block_size)
    return cache, cache.block_table(range(batch))


class TestStepAt(unittest.TestCase):
    def test_equals_prepare(self):
        """A prefill chunk then decode steps: the same slots, lengths and offsets as host-side planning."""
        host, _ = reserved(tokens=0)
        device, table = reserved(tokens=12)
        for start, n in ((0, 5), (5, 1), (6, 1), (7, 3)):
            want = host.prepare({0: n, 1: n}, max_blocks=table.shape[1])
            got = device.step_at(torch.arange(start, start + n), table)
            for name in ("seq_lens", "cu_seqlens_q", "positions"):
                self.assertTrue(torch.equal(getattr(got, name), getattr(want, name)), (name, start))
            self.assertEqual((got.max_seqlen_q, got.num_tokens), (want.max_seqlen_q, want.num_tokens))
            # prepare allocates its own blocks; both map each position through their block table alike
            for step, t in ((got, table), (want, want.block_table)):
                pos = step.positions.view(2, n)
                self.assertTrue(torch.equal(step.slot_mapping.view(2, n), t.long().gather(1, pos // 4) * 4 + pos % 4))

    def test_per_sequence_positions_and_attention(self):
        cache, table = reserved(tokens=12)
        pos = torch.tensor([[2, 3], [9, 10]])  # [B, T]: sequences at different lengths
        step = cache.step_at(pos, table)
        self.assertEqual(step.seq_lens.tolist(), [4, 11])
        want_slots = [int(table[b, p // 4]) * 4 + p % 4 for b in range(2) for p in pos[b].tolist()]
        self.assertEqual(step.slot_mapping.tolist(), want_slots)
        key = torch.randn(4, 2, 8)
        cache.write(0, key, key, step)
        self.assertTrue(torch.equal(cache.k_caches[0].view(-1, 2, 8)[step.slot_mapping], key))
        out = cache.attention(0, torch.randn(4, 4, 8), step)
        self.assertEqual(tuple(out.shape), (4, 4, 8))

    def test_compiled_step_does_not_recompile(self):
        cache, table = reserved(batch=3, tokens=16)
        eager_cache, _ = reserved(batch=3, tokens=16)
        counter = CompileCounter()
        torch._dynamo.reset()

        def step(c, q, k, pos, bt):
            s = c.step_at(pos, bt)
            c.write(0, k, k, s)
            return c.attention(0, q, s)

        f = torch.compile(step, fullgraph=True, backend=counter)
        for p in range(10):
            q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
            got = f(cache, q, k, torch.tensor([p]), table)
            want = step(eager_cache, q, k, torch.tensor([p]), table)
            self.assertTrue(torch.equal(got, want))
        self.assertEqual(counter.frame_count, 1)


class TestContracts(expecttest.TestCase):
    def setUp(self):
        self.cache, self.table = reserved(tokens=8)  # capacity 8 per sequence

    def check(self, pos, table=None):
        table = self.table if table is None else table
        return raises_everywhere(self, ValueError, lambda p, t: self.cache.step_at(p, t).slot_mapping, (pos, table),
                                 compile_exc=PY_ERROR)

    def test_metadata(self):
        self.assertExpectedInline(self.check(torch.tensor([1.0])), """PagedKVCache.step_at: positions must be an int32/int64 tensor [num_new_tokens] (shared by every sequence, as gpt-fast's input_pos) or [batch, num_new_tokens] with at least one token, got shape (1,) and dtype torch.float32. Each sequence's positions are its new tokens' positions, consecutive (a prefill chunk arange(s, s + T), a decode step [s]). Pass positions.to(torch.int64) (built with integer ops: // rather than /).""")
        self.assertExpectedInline(self.check(torch.zeros(2, 0, dtype=torch.int64)), """PagedKVCache.step_at: positions must be an int32/int64 tensor [num_new_tokens] (shared by every sequence, as gpt-fast's input_pos) or [batch, num_new_tokens] with at least one token, got shape (2, 0) and dtype torch.int64. Each sequence's positions are its new tokens' positions, consecutive (a prefill chunk arange(s, s + T), a decode step [s]). Pass at least one position per sequence.""")
        self.assertExpectedInline(self.check(torch.zeros(3, 1, dtype=torch.int64)), """PagedKVCache.step_at: positions of shape (3, 1) has 3 rows but block_table has 2; pass one row of positions per sequence (or a 1-D tensor shared by all).""")
        self.assertExpectedInline(self.check(torch.tensor([1]), self.table.long()), """PagedKVCache.step_at: block_table must be an int32 tensor [batch, max_blocks] with max_blocks >= 1 (PagedKVCache.block_table(seq_ids) gives it for sequences whose blocks are reserved), got shape (2, 2) and dtype torch.int64. Pass block_table.to(torch.int32).""")

    def test_block_table_of_reserved_sequences(self):
        self.assertEqual(self.cache.block_table([1], max_blocks=4).tolist(), [self.cache.block_ids(1) + [0, 0]])
        with self.assertRaises(ValueError) as cm:
            self.cache.block_table([0, 1], max_blocks=1)
        self.assertExpectedInline(str(cm.exception), """PagedKVCache.block_table: a sequence holds 2 blocks but max_blocks=1; pass max_blocks >= 2.""")
        with self.assertRaises(ValueError) as cm:
            self.cache.block_table([7])
        self.assertExpectedInline(str(cm.exception), """PagedKVCache: unknown sequence 7; add it with add_sequence first.""")

    def test_value_contract(self):
        f = self.cache.step_at
        with self.assertRaises(RuntimeError) as cm:
            f(torch.tensor([8]), self.table)
        self.assertExpectedInline(str(cm.exception), """PagedKVCache.step_at: positions[0, 0] = 8 is outside [0, 8), the positions block_table addresses (2 blocks x block_size 4). Reserve more blocks for sequence 0 (a wider block_table) or stop before its capacity.""")
        bad_table = self.table.clone()
        bad_table[1, 1] = 99
        with self.assertRaises(RuntimeError) as cm:
            f(torch.tensor([[0], [5]]), bad_table)
        self.assertExpectedInline(str(cm.exception), """PagedKVCache.step_at: block_table[1, 1] = 99 is not a block of the cache (block ids are in [0, 16)), and sequence 1 writes position 5 into it. Pass the block table of sequences whose blocks are reserved (PagedKVCache.block_table(seq_ids)).""")
        f(torch.tensor([[0], [3]]), bad_table)  # block 1 of sequence 1 is not written: fine
        with kvops.value_checks("off"):  # unchecked: such tokens are skipped, lengths clamped
            step = f(torch.tensor([[7, 8], [4, 5]]), bad_table)
        self.assertEqual(step.slot_mapping.tolist()[1:], [-1, -1, -1])
        self.assertEqual(step.seq_lens.tolist(), [8, 6])

    def test_value_contract_async_compiled_and_exported(self):
        def call(p, t):
            return self.cache.step_at(p, t).slot_mapping

        with kvops.value_checks("async"):
            with self.assertRaisesRegex(RuntimeError, r"positions hold a position outside \[0, max_blocks"):
                call(torch.tensor([8]), self.table)
            torch._dynamo.reset()
            compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
            self.assertEqual(compiled(torch.tensor([3]), self.table).tolist(),
                             call(torch.tensor([3]), self.table).tolist())
            with self.assertRaisesRegex(RuntimeError, r"positions hold a position outside"):
                compiled(torch.tensor([-1]), self.table)
            ep = torch.export.export(_Wrap(call), (torch.tensor([0]), self.table))
        with self.assertRaisesRegex(RuntimeError, r"positions hold a position outside"):
            ep.module()(torch.tensor([8]), self.table)


if __name__ == "__main__":
    unittest.main()

"""PagedKVCache: block manager against a Python model (hypothesis), step metadata, padding, compile count, errors."""

import math
import unittest

import expecttest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvops
from kvops.cache import OutOfBlocksError, PagedKVCache
from tests.contract import _Wrap


class Model:
    """The oracle: each sequence is its token values plus *logical* block ids (fresh per allocation, shared by fork).

    It knows nothing of physical ids or the free list: free blocks = P - |distinct logical blocks in use|.
    """

    def __init__(self, num_blocks, block_size):
        self.p, self.bs = num_blocks, block_size
        self.seqs = {}  # id -> (tokens, logical blocks)
        self.next_block = 0

    def free_blocks(self):
        return self.p - len({b for _, blocks in self.seqs.values() for b in blocks})

    def needed(self, seq_id, n):
        tokens, blocks = self.seqs[seq_id]
        return math.ceil((len(tokens) + n) / self.bs) - len(blocks)

    def extend(self, seq_id, values):
        tokens, blocks = self.seqs[seq_id]
        for _ in range(self.needed(seq_id, len(values))):
            blocks.append(self.next_block)
            self.next_block += 1
        tokens.extend(values)

    def fork(self, parent, child):
        tokens, blocks = self.seqs[parent]
        n = len(tokens) // self.bs * self.bs
        self.seqs[child] = (tokens[:n], blocks[: n // self.bs])


class Harness:
    """Drives a PagedKVCache and its Model side by side; writes token values through the cache's write op."""

    def __init__(self, test, num_blocks, block_size, joint):
        self.test = test
        self.cache = PagedKVCache(num_blocks, block_size, 1, 2, dtype=torch.float32, joint=joint)
        self.model = Model(num_blocks, block_size)
        self.next_id = 0
        self.next_value = 1.0
        self.rejected = 0
        for _ in range(2):
            self.add()

    def add(self):
        self.cache.add_sequence(self.next_id)
        self.model.seqs[self.next_id] = ([], [])
        self.next_id += 1

    def snapshot(self):
        c = self.cache
        return ({s: (c.seq_len(s), c.block_ids(s)) for s in c.seq_ids}, c.num_free_blocks,
                c.k_caches[0].clone(), c.v_caches[0].clone())

    def check(self):
        c, m, t = self.cache, self.model, self.test
        t.assertEqual(sorted(c.seq_ids), sorted(m.seqs))
        t.assertEqual(c.num_free_blocks, m.free_blocks())
        phys_of = {}  # logical -> physical must be a bijection
        holders = {}
        for seq_id, (tokens, blocks) in m.seqs.items():
            phys = c.block_ids(seq_id)
            t.assertEqual(c.seq_len(seq_id), len(tokens))
            t.assertEqual(len(phys), len(blocks))
            for logical, p in zip(blocks, phys):
                t.assertEqual(phys_of.setdefault(logical, p), p)
                holders[p] = holders.get(p, 0) + 1
            # contents: gather every position through the block list
            bs = c.block_size
            pos = torch.arange(len(tokens))
            rows = torch.tensor(phys, dtype=torch.int64)[pos // bs] if tokens else pos
            k = c.k_caches[0][rows, pos % bs, 0]
            t.assertTrue(torch.equal(k, torch.tensor(tokens).view(-1, 1).expand(-1, 2)))
            t.assertTrue(torch.equal(c.v_caches[0][rows, pos % bs, 0], -k))
        t.assertEqual(len(set(phys_of.values())), len(phys_of))
        for p, count in holders.items():
            t.assertEqual(c.ref_count(p), count)

    def step(self, counts, pad_tokens, pad_batch, fixed_width):
        c, m, t = self.cache, self.model, self.test
        live = list(m.seqs)
        new = {}
        for idx, k in counts if live else ():
            new.setdefault(live[idx % len(live)], k)
        ids, counts = list(new), list(new.values())
        n = sum(counts)
        pad_t = n + pad_tokens
        pad_b = None if pad_batch is None else len(ids) + pad_batch
        needed = sum(m.needed(s, k) for s, k in new.items())
        widths = [math.ceil((len(m.seqs[s][0]) + k) / m.bs) for s, k in new.items()]
        width = (max(widths, default=0) + 1) if fixed_width else None
        before = self.snapshot()
        bad_padding = pad_b is not None and pad_tokens and pad_batch == 0  # padding tokens but no padding row
        if bad_padding or needed > m.free_blocks():  # argument errors are reported before a lack of blocks
            with t.assertRaises(ValueError if bad_padding else OutOfBlocksError):
                c.prepare(new, pad_tokens=pad_t, pad_batch=pad_b, max_blocks=width)
            after = self.snapshot()
            t.assertEqual(after[:2], before[:2])
            t.assertTrue(torch.equal(after[2], before[2]) and torch.equal(after[3], before[3]))
            self.rejected += 1
            return
        step = c.prepare(new, pad_tokens=pad_t, pad_batch=pad_b, max_blocks=width)
        values = {}
        for s, k in new.items():
            values[s] = [self.next_value + i for i in range(k)]
            self.next_value += k
        flat = [v for s in ids for v in values[s]]
        key = torch.full((pad_t, 1, 2), float("nan"))  # padding rows: NaN, must never land anywhere
        key[:n] = torch.tensor(flat).view(-1, 1, 1)
        c.write(0, key, -key[:, :, :1].expand(-1, -1, 2), step)
        for s in ids:
            m.extend(s, values[s])
        # metadata against the model
        rows = step.block_table.shape[0]
        t.assertEqual(step.slot_mapping.shape[0], pad_t)
        t.assertEqual(step.num_tokens, n)
        t.assertEqual(step.cu_seqlens_q.tolist()[-1], pad_t)
        t.assertEqual(step.cu_seqlens_q.shape[0], rows + 1)
        q_lens = step.cu_seqlens_q.diff().tolist()
        t.assertEqual(q_lens[: len(ids)], counts)
        t.assertEqual(step.seq_lens.tolist(), [len(m.seqs[s][0]) for s in ids] + [0] * (rows - len(ids)))
        t.assertEqual(step.max_seqlen_q, max(q_lens, default=0))
        if width is not None:
            t.assertEqual(step.block_table.shape[1], width)
        for r, s in enumerate(ids):
            phys = c.block_ids(s)
            t.assertEqual(step.block_table[r, : len(phys)].tolist(), phys)
        expected_slots = []
        for s, k in new.items():
            phys, length = c.block_ids(s), len(m.seqs[s][0])
            expected_slots += [phys[p // m.bs] * m.bs + p % m.bs for p in range(length - k, length)]
        t.assertEqual(step.slot_mapping.tolist(), expected_slots + [-1] * pad_tokens)
        for dtype, tensor in ((torch.int32, step.block_table), (torch.int32, step.seq_lens),
                              (torch.int32, step.cu_seqlens_q), (torch.int64, step.slot_mapping)):
            t.assertEqual(tensor.dtype, dtype)


OPS = st.tuples(
    st.sampled_from(["add", "step", "step", "step", "fork", "free"]),  # (steps weighted up)
    st.integers(0, 7),  # which live sequence (fork/free)
    st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=3),  # step: (sequence, tokens)
    st.integers(0, 3),  # step: padding tokens
    st.sampled_from([None, 0, 1, 2]),  # step: padding rows (None: default)
    st.booleans(),  # step: fixed block_table width
)


class TestBlockManagerModel(unittest.TestCase):
    @settings(derandomize=True, max_examples=60, deadline=None)
    @given(block_size=st.sampled_from([1, 3]), joint=st.booleans(), ops=st.lists(OPS, min_size=4, max_size=20))
    def test_against_model(self, block_size, joint, ops):
        h = Harness(self, num_blocks=8, block_size=block_size, joint=joint)
        for op in ops:
            live = list(h.model.seqs)
            if op[0] == "add":
                h.add()
            elif op[0] == "step":
                h.step(*op[2:])
            elif op[0] == "fork" and live:
                parent = live[op[1] % len(live)]
                shared = len(h.model.seqs[parent][0]) // block_size * block_size
                self.assertEqual(h.cache.fork(parent, h.next_id), shared)
                h.model.fork(parent, h.next_id)
                h.next_id += 1
            elif op[0] == "free" and live:
                seq_id = live[op[1] % len(live)]
                h.cache.free(seq_id)
                del h.model.seqs[seq_id]
            h.check()


class TestPagedKVCache(expecttest.TestCase):
    def test_extend_slots_and_reuse(self):
        c = PagedKVCache(4, 2, 1, 4, dtype=torch.float32)
        c.add_sequence("a")
        c.add_sequence("b")
        self.assertEqual(c.extend("a", 3), [0, 1, 2])  # blocks 0, 1
        self.assertEqual(c.extend("b", 1), [4])  # block 2
        self.assertEqual(c.extend("a", 2), [3, 6])  # fills block 1, then block 3
        self.assertEqual(c.num_free_blocks, 0)
        c.free("a")
        self.assertEqual(c.num_free_blocks, 3)
        c.add_sequence("c")
        self.assertEqual(c.extend("c", 3), [0, 1, 2])  # freed blocks are reused, lowest id first
        self.assertEqual(c.extend("b", 0), [])

    def test_fork_shares_full_blocks_read_only(self):
        c = PagedKVCache(6, 4, 1, 2, dtype=torch.float32)
        c.add_sequence(0)
        c.extend(0, 10)  # blocks [0, 1, 2], last one half full
        self.assertEqual(c.fork(0, 1), 8)  # only the two full blocks are shared
        self.assertEqual(c.block_ids(1), [0, 1])
        self.assertEqual([c.ref_count(b) for b in range(4)], [2, 2, 1, 0])
        self.assertEqual(c.extend(1, 1), [12])  # the child continues in its own block
        self.assertEqual(c.fork(0, 2, num_tokens=4), 4)
        c.free(0)
        self.assertEqual([c.ref_count(b) for b in range(4)], [2, 1, 0, 1])
        self.assertEqual(c.num_free_blocks, 3)

    def test_out_of_blocks_is_atomic(self):
        c = PagedKVCache(3, 2, 1, 2, dtype=torch.float32)
        for s in "ab":
            c.add_sequence(s)
        c.extend("a", 2)
        with self.assertRaises(OutOfBlocksError) as cm:
            c.prepare({"a": 1, "b": 3})  # needs 1 + 2 blocks, 2 free
        self.assertExpectedInline(
            str(cm.exception),
            """PagedKVCache: out of blocks: a step of 4 tokens over 2 sequences needs 3 new blocks of 2 tokens but only 2 of 3 are free; nothing was allocated. Free finished sequences or allocate more blocks.""",
        )
        self.assertEqual((c.seq_len("a"), c.seq_len("b"), c.num_free_blocks), (2, 0, 2))
        with self.assertRaises(OutOfBlocksError) as cm:
            c.extend("b", 5)
        self.assertExpectedInline(
            str(cm.exception),
            """PagedKVCache: out of blocks: extending sequence 'b' by 5 tokens needs 3 new blocks of 2 tokens but only 2 of 3 are free; nothing was allocated. Free finished sequences or allocate more blocks.""",
        )
        self.assertEqual((c.seq_len("b"), c.num_free_blocks), (0, 2))

    def test_errors(self):
        c = PagedKVCache(4, 2, 1, 2, dtype=torch.float32)
        c.add_sequence("a")
        c.extend("a", 3)
        cases = [
            (lambda: c.add_sequence("a"), ValueError),
            (lambda: c.extend("zz", 1), ValueError),
            (lambda: c.extend("a", -1), ValueError),
            (lambda: c.fork("a", "a"), ValueError),
            (lambda: c.fork("a", "b", num_tokens=3), ValueError),
            (lambda: c.prepare([("a", 1), ("a", 1)]), ValueError),
            (lambda: c.prepare({"a": 2}, max_blocks=2), ValueError),
            (lambda: c.prepare({"a": 1}, pad_tokens=0), ValueError),
            (lambda: c.prepare({"a": 1}, pad_tokens=2, pad_batch=1), ValueError),
            (lambda: PagedKVCache(4, 2, 1, 8, head_dim_v=4, joint=True), ValueError),
            (lambda: PagedKVCache(0, 2, 1, 8), ValueError),
        ]
        messages = []
        for fn, exc in cases:
            with self.assertRaises(exc) as cm:
                fn()
            messages.append(str(cm.exception))
        self.assertEqual((c.seq_len("a"), c.num_free_blocks), (3, 2))  # the failed calls changed nothing
        self.assertExpectedInline(
            "\n".join(messages),
            """\
PagedKVCache: sequence 'a' already exists; free it first or use a new id.
PagedKVCache: unknown sequence 'zz'; add it with add_sequence first.
PagedKVCache: num_tokens must be >= 0, got -1 for sequence 'a'.
PagedKVCache: sequence 'a' already exists; fork into a new id.
PagedKVCache: fork of 'a' can share only whole blocks of its 3 tokens (block_size 2; no copy-on-write), got num_tokens=3. Pass a multiple of 2 up to 2.
PagedKVCache.prepare: a sequence appears twice in one step: ['a', 'a'].
PagedKVCache.prepare: a sequence needs 3 blocks but max_blocks=2; raise max_blocks to at least 3.
PagedKVCache.prepare: pad_tokens=0 is less than the step's 1 tokens.
PagedKVCache.prepare: pad_batch=1 must be >= the 1 sequences of the step, and larger when pad_tokens adds tokens (padding tokens need a padding row).
PagedKVCache: joint=True views K and V of one [P, block_size, 2, H_kv, D] allocation and needs head_dim_v == head_dim, got 4 and 8. Pass joint=False.
PagedKVCache: num_blocks must be positive, got 0.""",
        )

    def test_joint_allocation(self):
        c = PagedKVCache(3, 2, 2, 4, num_layers=2, dtype=torch.float16, joint=True)
        for k, v in zip(c.k_caches, c.v_caches):
            self.assertEqual(k._base.shape, (3, 2, 2, 2, 4))
            self.assertIs(k._base, v._base)
        self.assertIsNot(c.k_caches[0]._base, c.k_caches[1]._base)

    def test_padded_decode_padding_rows(self):
        c = PagedKVCache(8, 4, 1, 2, dtype=torch.float32)
        for s in range(2):
            c.add_sequence(s)
        step = c.prepare({0: 5, 1: 1}, pad_tokens=9, pad_batch=4, max_blocks=3)
        self.assertEqual(step.cu_seqlens_q.tolist(), [0, 5, 6, 8, 9])  # 3 padding tokens over 2 padding rows
        self.assertEqual(step.seq_lens.tolist(), [5, 1, 0, 0])
        self.assertEqual(step.block_table.tolist(), [[0, 1, 0], [2, 0, 0], [0, 0, 0], [0, 0, 0]])
        self.assertEqual(step.slot_mapping.tolist(), [0, 1, 2, 3, 4, 8, -1, -1, -1])
        self.assertEqual(step.positions.tolist(), [0, 1, 2, 3, 4, 0, 0, 0, 0])  # padding tokens: position 0
        self.assertEqual(step.max_seqlen_q, 5)

    def test_positions_of_prefill_chunks_and_decode(self):
        """PagedStep.positions [N_pad] int64: each new token's position in its sequence (for RoPE)."""
        c = PagedKVCache(8, 4, 1, 2)
        for s in "abc":
            c.add_sequence(s)
        c.prepare({"a": 6, "b": 2})
        c.fork("a", "d")  # shares a's first 4 tokens
        step = c.prepare([("b", 1), ("a", 3), ("c", 2), ("d", 1)], pad_tokens=9)
        self.assertEqual(step.positions.dtype, torch.int64)
        self.assertEqual(step.positions.tolist(), [2, 6, 7, 8, 0, 1, 4, 0, 0])
        self.assertEqual(step.positions.tolist()[:step.num_tokens],
                         [c.seq_len(s) - n + i for s, n in [("b", 1), ("a", 3), ("c", 2), ("d", 1)] for i in range(n)])

    def test_dtype_and_device_follow_torch_defaults(self):
        """One rule, like torch factories and CausalKVCache.allocate: dtype None -> torch.get_default_dtype()."""
        self.assertEqual(PagedKVCache(2, 2, 1, 2).k_caches[0].dtype, torch.float32)
        old = torch.get_default_dtype()
        try:
            torch.set_default_dtype(torch.float64)
            c = PagedKVCache(2, 2, 1, 2, joint=True)
            causal = kvops.CausalKVCache.allocate(1, 4, 1, 2)
        finally:
            torch.set_default_dtype(old)
        self.assertEqual((c.k_caches[0].dtype, c.v_caches[0].dtype, causal.k.dtype), (torch.float64,) * 3)
        self.assertEqual(c.device, torch.get_default_device())
        self.assertEqual(PagedKVCache(2, 2, 1, 2, dtype=torch.float16).k_caches[0].dtype, torch.float16)

    def test_prepare_is_eager_only(self):
        """Host-side planning: a clear error under torch.compile and torch.export, and nothing allocated."""
        c = PagedKVCache(4, 2, 1, 2)
        c.add_sequence(0)

        def plan(x):
            step = c.prepare({0: 3})
            return x + step.seq_lens

        torch._dynamo.reset()
        with self.assertRaises(torch._dynamo.exc.Unsupported) as cm:
            torch.compile(plan, fullgraph=True, backend="eager")(torch.zeros(1, dtype=torch.int32))
        self.assertIn("PagedKVCache.prepare is host-side planning (Python block manager) and runs eagerly only",
                      str(cm.exception))
        with self.assertRaises(RuntimeError) as cm:
            torch.export.export(_Wrap(plan), (torch.zeros(1, dtype=torch.int32),), strict=False)
        self.assertExpectedInline(str(cm.exception), """PagedKVCache.prepare is host-side planning (Python block manager) and runs eagerly only; it was called while compiling (torch.compile or torch.export). Call cache.prepare(...) outside the compiled function and pass the PagedStep's tensors (block_table, seq_lens, cu_seqlens_q, slot_mapping, positions) and max_seqlen_q to it as arguments, or, with blocks reserved up front, build the step inside it from a tensor of positions with cache.step_at(positions, block_table).""")  # noqa: E501
        self.assertEqual((c.seq_len(0), c.num_free_blocks), (0, 4))
        self.assertEqual(plan(torch.zeros(1, dtype=torch.int32)).tolist(), [3])  # eager planning works


class TestWriteAndAttention(unittest.TestCase):
    def test_prefill_then_decode_against_gathered_reference(self):
        """cache.write + cache.attention (causal, GQA 2:1, fp32) equal softmax over each sequence's gathered K/V."""
        torch.manual_seed(0)
        h_q, h_kv, d = 4, 2, 8
        c = PagedKVCache(12, 4, h_kv, d, dtype=torch.float32, num_layers=2)
        history = {0: ([], []), 1: ([], [])}  # per sequence: all keys and values written so far
        for s in history:
            c.add_sequence(s)
        for new in ({0: 6, 1: 3}, {0: 1, 1: 1}, {1: 2}):
            step = c.prepare(new, pad_tokens=sum(new.values()) + 2, pad_batch=len(new) + 1)
            n_pad = step.slot_mapping.shape[0]
            q, k, v = torch.randn(n_pad, h_q, d), torch.randn(n_pad, h_kv, d), torch.randn(n_pad, h_kv, d)
            c.write(1, k, v, step)
            out = c.attention(1, q, step)
            row = 0
            for s, n in new.items():
                history[s][0].append(k[row : row + n])
                history[s][1].append(v[row : row + n])
                keys, vals = torch.cat(history[s][0]).double(), torch.cat(history[s][1]).double()
                length = keys.shape[0]
                for i in range(n):
                    pos = length - n + i
                    for h in range(h_q):
                        scores = keys[: pos + 1, h // 2] @ q[row + i, h].double() * d**-0.5
                        want = torch.softmax(scores, 0) @ vals[: pos + 1, h // 2]
                        torch.testing.assert_close(out[row + i, h].double(), want, atol=1e-5, rtol=1e-5)
                row += n
            self.assertTrue(torch.equal(out[row:], torch.zeros(n_pad - row, h_q, d)))  # padding rows
        self.assertTrue(bool((c.k_caches[0] == 0).all()))  # layer 0 never written


class TestPagedDecodeLoop(unittest.TestCase):
    def test_static_shapes_compile_once(self):
        """A compiled decode step (write + attention) over growing sequences with fixed padded shapes: one graph."""
        torch.manual_seed(0)
        h_q, h_kv, d = 4, 2, 16
        c = PagedKVCache(16, 4, h_kv, d, dtype=torch.float32, joint=True)
        ref = PagedKVCache(16, 4, h_kv, d, dtype=torch.float32, joint=True)

        def decode(q, k, v, kc, vc, block_table, seq_lens, cu, slots):
            kvops.paged_cache_write(k, v, kc, vc, slots)
            return kvops.paged_attention(q, kc, vc, cu, seq_lens, block_table, 1)

        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(decode, fullgraph=True, backend="aot_eager")
        for cache in (c, ref):
            for s in range(3):
                cache.add_sequence(s)
            cache.prepare({0: 3, 1: 0, 2: 5})  # earlier prompt positions (left as zeros)
        for t in range(6):
            active = {0: 1, 2: 1} if t % 2 else {0: 1, 1: 1, 2: 1}  # batch size varies, padded shapes do not
            q, k, v = torch.randn(4, h_q, d), torch.randn(4, h_kv, d), torch.randn(4, h_kv, d)
            outs = []
            for cache, fn in ((c, compiled), (ref, decode)):
                st_ = cache.prepare(active, pad_tokens=4, pad_batch=4, max_blocks=4)
                self.assertEqual(st_.max_seqlen_q, 1)
                outs.append(fn(q, k, v, cache.k_caches[0], cache.v_caches[0], st_.block_table, st_.seq_lens,
                               st_.cu_seqlens_q, st_.slot_mapping))
            self.assertTrue(torch.equal(outs[0], outs[1]))
            self.assertTrue(torch.equal(outs[0][len(active):], torch.zeros(4 - len(active), h_q, d)))
        self.assertEqual(torch._dynamo.utils.counters["stats"]["unique_graphs"], 1)
        self.assertTrue(torch.equal(c.k_caches[0], ref.k_caches[0]))


if __name__ == "__main__":
    unittest.main()

"""The transfer planner (kvops.transfer.routing): worked cases of docs/semantics.md §6, exhaustively checked invariants."""

import itertools
import unittest
from types import SimpleNamespace

import expecttest

from kvops.transfer import (
    HeadSlice,
    KVArgs,
    check_transfer_metadata,
    compute_grid_segments,
    compute_head_slice_params,
    routes_for_writer,
    rank_head_range,
    resolve_total_kv_heads,
    staging_grid_tokens,
    writer_bytes,
)


def writers(p_tp, d_tp, heads):
    return [compute_head_slice_params(p_tp, d_tp, d, heads) for d in range(d_tp)]


class TestWorkedCases(expecttest.TestCase):
    def test_gather_4_2_8(self):
        # each decode rank has two writers with destination head starts [0, 2] (2 heads each)
        for d, slices in enumerate(writers(4, 2, 8)):
            self.assertEqual([s.cache_head_start for s in slices], [0, 2])
            self.assertEqual([s.num_heads for s in slices], [2, 2])
            self.assertEqual([s.writer for s in slices], [2 * d, 2 * d + 1])
            self.assertEqual([s.src_head_start for s in slices], [0, 0])

    def test_scatter_2_4_8(self):
        self.assertEqual([s.src_head_start for (s,) in writers(2, 4, 8)], [0, 2, 0, 2])
        self.assertEqual([s.writer for (s,) in writers(2, 4, 8)], [0, 0, 1, 1])

    def test_decode_replication_1_4_2(self):
        # consecutive decode ranks share a head (0, 0, 1, 1), never 0, 1, 0, 1 (sglang's GQA replication bug)
        self.assertEqual([s.src_head_start for (s,) in writers(1, 4, 2)], [0, 0, 1, 1])
        self.assertEqual([rank_head_range(2, 4, r) for r in range(4)], [(0, 1), (0, 1), (1, 2), (1, 2)])

    def test_prefill_replication_8_2_2(self):
        # each head lives on 4 prefill ranks; one writer per head, no duplicate bytes
        self.assertEqual(writers(8, 2, 2), [(HeadSlice(0, 0, 1, 0),), (HeadSlice(4, 0, 1, 0),)])
        senders = [p for p in range(8) if routes_for_writer(8, 2, p, 2)]
        self.assertEqual(senders, [0, 4])

    def test_4_1_8_and_equal(self):
        self.assertEqual([(s.writer, s.cache_head_start) for s in writers(4, 1, 8)[0]],
                         [(0, 0), (1, 2), (2, 4), (3, 6)])
        self.assertEqual(writers(2, 2, 8), [(HeadSlice(0, 0, 4, 0),), (HeadSlice(1, 0, 4, 0),)])

    def test_replication_on_both_sides_spreads_over_replicas(self):
        # (4, 8, 2): decode ranks 0-3 need head 0, held by prefill ranks 0 and 1: they alternate
        self.assertEqual([s.writer for (s,) in writers(4, 8, 2)], [0, 1, 0, 1, 2, 3, 2, 3])

    def test_unequal_slices(self):
        # H=12, P_tp=3 (4 heads each), D_tp=2 (6 heads each): decode rank 0 takes 4 + 2 heads
        self.assertEqual(writers(3, 2, 12)[0], (HeadSlice(0, 0, 4, 0), HeadSlice(1, 0, 2, 4)))
        self.assertEqual(writers(3, 2, 12)[1], (HeadSlice(1, 2, 2, 0), HeadSlice(2, 0, 4, 2)))

    def test_bytes_per_writer(self):
        # tokens * heads * bytes_per_head_token * layers * 2
        self.assertEqual(writer_bytes(14336, 2, 64 * 2, 16), 14336 * 2 * 128 * 16 * 2)
        self.assertEqual(writer_bytes(0, 2, 128, 16), 0)

    def test_staging_grid(self):
        self.assertEqual(staging_grid_tokens(), 8192)
        self.assertEqual(staging_grid_tokens(8192, 64), 8192)
        self.assertEqual(staging_grid_tokens(100, 16), 96)  # whole pages
        self.assertEqual(staging_grid_tokens(8, 16), 16)  # at least one page
        self.assertEqual(compute_grid_segments(0, 14336, 0, 8192), [(0, 8192), (8192, 14336)])
        self.assertEqual(compute_grid_segments(0, 8, 0, 8), [(0, 8)])

    def test_sglang_semantics(self):
        # after sglang's staging helpers: an empty range is one empty segment (the metadata-only last
        # chunk of a fully cached prompt), None means the default chunked-prefill size, a global decode rank maps
        # to its rank in the TP group
        self.assertEqual(compute_grid_segments(5, 5, 0, 8), [(5, 5)])
        self.assertEqual(compute_grid_segments(4096, 4096, 0, 8192), [(4096, 4096)])
        self.assertEqual(compute_grid_segments(0, 0, 0, 8), [(0, 0)])
        self.assertEqual(staging_grid_tokens(None, 64), 8192)
        self.assertEqual(staging_grid_tokens(None, 48), 8160)
        self.assertEqual(staging_grid_tokens(None), 8192)
        for p_tp, d_tp, heads in ((4, 2, 8), (2, 4, 8), (1, 4, 2), (8, 2, 2), (4, 8, 2)):
            for global_rank in range(3 * d_tp):
                self.assertEqual(compute_head_slice_params(p_tp, d_tp, global_rank, heads),
                                 compute_head_slice_params(p_tp, d_tp, global_rank % d_tp, heads))
        self.assertEqual(compute_head_slice_params(2, 4, 6, 8), (HeadSlice(1, 0, 2, 0),))  # global 6 = TP rank 2
        self.assertEqual(compute_grid_segments(3, 20, 0, 8), [(3, 8), (8, 16), (16, 20)])
        self.assertEqual(compute_grid_segments(3, 20, 2, 8), [(3, 10), (10, 18), (18, 20)])
        self.assertEqual(compute_grid_segments(0, 8, 0, 8), [(0, 8)])

    def test_rank_is_taken_modulo_the_tp_group(self):
        """sglang's rule (``src_tp_rank % src_attn_tp_size``, ``dst_tp_rank % dst_attn_tp_size``): a global rank maps
        to its rank in the TP group, on the prefill side (routes_for_writer) as on the decode side."""
        for p_tp, d_tp, heads in ((4, 2, 8), (2, 4, 8), (1, 4, 2), (8, 2, 2), (4, 8, 2), (4, 4, 8)):
            for rank in range(3 * p_tp):
                self.assertEqual(routes_for_writer(p_tp, d_tp, rank, heads),
                                 routes_for_writer(p_tp, d_tp, rank % p_tp, heads))
                self.assertEqual(rank_head_range(heads, p_tp, rank), rank_head_range(heads, p_tp, rank % p_tp))
        self.assertEqual(routes_for_writer(4, 2, 5, 8), ((0, HeadSlice(1, 0, 2, 2)),))  # global 5 = prefill TP rank 1
        with self.assertRaises(ValueError) as cm:
            routes_for_writer(4, 2, -1, 8)
        self.assertExpectedInline(str(cm.exception), """prefill tp_rank=-1 must be a non-negative int (a TP rank, or a global rank, which is taken modulo prefill tp_size=4 as sglang does).""")  # noqa: B950
        with self.assertRaises(ValueError) as cm:
            rank_head_range(8, 4, 1.0)
        self.assertExpectedInline(str(cm.exception), """tp_rank=1.0 must be a non-negative int (a TP rank, or a global rank, which is taken modulo tp_size=4 as sglang does).""")  # noqa: B950

    def test_invariants_exhaustive(self):
        # every decode rank receives each of its heads exactly once, from a prefill rank that holds it
        for heads in (1, 2, 4, 8, 12):
            tps = [t for t in range(1, 17) if heads % t == 0 or t % heads == 0]
            for p_tp, d_tp in itertools.product(tps, tps):
                for d, slices in enumerate(writers(p_tp, d_tp, heads)):
                    ds, de = rank_head_range(heads, d_tp, d)
                    got = []
                    for s in slices:
                        ps, pe = rank_head_range(heads, p_tp, s.writer)
                        g0 = ps + s.src_head_start
                        self.assertLessEqual(g0 + s.num_heads, pe)
                        self.assertEqual(ds + s.cache_head_start, g0)
                        got += range(g0, g0 + s.num_heads)
                    self.assertEqual(got, list(range(ds, de)), (p_tp, d_tp, heads, d))


class TestErrors(expecttest.TestCase):
    def test_resolve_total_kv_heads(self):
        self.assertEqual(resolve_total_kv_heads(SimpleNamespace(total_kv_head_num=8, kv_head_num=1), 16), 8)
        self.assertEqual(resolve_total_kv_heads(SimpleNamespace(total_kv_head_num=0, kv_head_num=2), 4), 8)
        self.assertEqual(resolve_total_kv_heads(SimpleNamespace(kv_head_num=2), 4), 8)
        with self.assertRaises(ValueError) as cm:
            resolve_total_kv_heads(SimpleNamespace(), 4)
        self.assertExpectedInline(str(cm.exception), """Cannot resolve total_kv_heads: kv_args has neither total_kv_head_num nor kv_head_num. Ensure DecodePreallocQueue._init_kv_manager sets kv_args.kv_head_num.""")  # noqa: B950
        with self.assertRaises(ValueError):
            resolve_total_kv_heads(SimpleNamespace(total_kv_head_num=0, kv_head_num=0), 4)

    def test_unsplittable(self):
        with self.assertRaises(ValueError) as cm:
            compute_head_slice_params(3, 2, 0, 8)
        self.assertExpectedInline(str(cm.exception), """total_kv_heads=8 cannot be split over prefill tp_size=3: need total_kv_heads % tp_size == 0 (each rank holds total_kv_heads // tp_size heads) or tp_size % total_kv_heads == 0 (each head replicated on tp_size // total_kv_heads ranks).""")  # noqa: B950
        with self.assertRaises(ValueError) as cm:
            compute_head_slice_params(2, 2, -1, 8)
        self.assertExpectedInline(str(cm.exception), """decode tp_rank=-1 must be a non-negative int (a TP rank, or a global rank, which is taken modulo decode tp_size=2 as sglang does).""")  # noqa: B950
        with self.assertRaises(ValueError) as cm:
            compute_grid_segments(4, 2, 0, 8)
        self.assertExpectedInline(str(cm.exception), """compute_grid_segments needs start <= end, got start=4, end=2.""")  # noqa: B950
        with self.assertRaises(ValueError):
            compute_grid_segments(0, 2, 0, 0)
        with self.assertRaises(ValueError):
            staging_grid_tokens(0, 16)

    def test_metadata_mismatch_names_both_values(self):
        prefill = KVArgs(8, 2, 64, "bfloat16", 16, 16, 4)
        check_transfer_metadata(prefill, KVArgs(8, 4, 64, "bfloat16", 16, 16, 2))  # only the TP split differs
        check_transfer_metadata(prefill, KVArgs(0, 4, 64, "bfloat16", 16, 16, 2))  # total resolved from per-rank
        for field, decode, want in (
            ("head_dim", KVArgs(8, 4, 128, "bfloat16", 16, 16, 2), "head_dim: prefill 64 vs decode 128"),
            ("dtype", KVArgs(8, 4, 64, "float16", 16, 16, 2), "dtype: prefill bfloat16 vs decode float16"),
            ("page_size", KVArgs(8, 4, 64, "bfloat16", 32, 16, 2), "page_size: prefill 16 vs decode 32"),
            ("num_layers", KVArgs(8, 4, 64, "bfloat16", 16, 12, 2), "num_layers: prefill 16 vs decode 12"),
            ("total_kv_heads", KVArgs(16, 8, 64, "bfloat16", 16, 16, 2), "total_kv_heads: prefill 8 vs decode 16"),
        ):
            with self.subTest(field=field), self.assertRaises(ValueError) as cm:
                check_transfer_metadata(prefill, decode)
            self.assertIn(want, str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            check_transfer_metadata(prefill, KVArgs(8, 4, 128, "float32", 16, 16, 2))
        self.assertExpectedInline(str(cm.exception), """KV transfer metadata mismatch: head_dim: prefill 64 vs decode 128; dtype: prefill bfloat16 vs decode float32. Both sides must serve the same model with the same KV cache layout (head_dim, dtype, page_size, layers, total KV heads); no KV was transferred.""")  # noqa: B950

    def test_kv_args_wire_round_trip(self):
        args = KVArgs(8, 2, 80, "float8_e4m3fn", 16, 3, 4)
        self.assertEqual(KVArgs.decode(args.encode()), args)


if __name__ == "__main__":
    unittest.main()


class TestEndpointErrors(expecttest.TestCase):
    """Argument errors of the transport, raised before any process group is touched."""

    def test_endpoints(self):
        import torch

        from kvops.cache import PagedKVCache
        from kvops.transfer import KVReceiver, KVSender, TransferGroups

        with self.assertRaises(ValueError) as cm:
            TransferGroups((0, 1), (1, 2))
        self.assertExpectedInline(str(cm.exception), """TransferGroups needs non-empty, disjoint prefill and decode ranks, got (0, 1) and (1, 2).""")  # noqa: B950
        groups = TransferGroups((0, 1), (2,))
        cache = PagedKVCache(4, 4, 2, 8, num_layers=2, dtype=torch.float32)
        with self.assertRaises(ValueError) as cm:
            KVSender(groups, 0, cache.k_caches, cache.v_caches, 2)  # prefill TP 2 of H=2 holds 1 head per rank
        self.assertExpectedInline(str(cm.exception), """prefill rank 0 caches hold 2 KV heads but total_kv_heads=2 over prefill tp_size=2 gives each rank 1; allocate caches with 1 KV heads.""")  # noqa: B950
        with self.assertRaises(ValueError) as cm:
            KVReceiver(groups, 1, cache, 2)
        self.assertExpectedInline(str(cm.exception), """decode tp_rank=1 is outside [0, 1).""")
        recv = KVReceiver(groups, 0, cache, 2)
        with self.assertRaises(ValueError) as cm:
            recv.receive("req-1", 4)
        self.assertExpectedInline(str(cm.exception), """request_id must be an int in [0, 1073741823] (it tags the request's messages), got 'req-1'.""")  # noqa: B950
        for bad in (-3, 1.5, None):  # today: "compute_grid_segments needs start <= end ..." for -3
            with self.assertRaises(ValueError) as cm:
                recv.receive(7, bad)
            self.assertIn("num_tokens must be a non-negative int", str(cm.exception))
        self.assertExpectedInline(str(cm.exception), """num_tokens must be a non-negative int (the request's token count, 0 for a metadata-only request), got None.""")  # noqa: B950
        self.assertEqual(cache.seq_ids, [])  # nothing allocated
        sender = KVSender(TransferGroups((0,), (1,)), 0, cache.k_caches, cache.v_caches, 2)
        with self.assertRaises(ValueError) as cm:
            sender.send(7, -3, torch.zeros(2, dtype=torch.int32))
        self.assertIn("num_tokens must be a non-negative int", str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            sender.send(7, 9, torch.zeros(2, dtype=torch.int32))
        self.assertExpectedInline(str(cm.exception), """KVSender.send: block_table of shape (2,) covers 8 tokens (block_size 4) but num_tokens=9; pass the request's 1-D block table.""")  # noqa: B950

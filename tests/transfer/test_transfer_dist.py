"""Prefill→decode KV transfer over torch.distributed (gloo, CPU) in spawned processes.

ONE world of 10 ranks runs every configuration in turn on rank subsets (process start costs seconds on this
machine): for (P_tp, D_tp, H) in CONFIGS, ranks ``[0, P_tp)`` prefill and ``[P_tp, P_tp + D_tp)`` decode. Synthetic
KV (seeded normal bf16 per request, every rank regenerates the full-head tensor) is written by each prefill rank
into its caches at a random permutation of blocks; each decode rank receives into a ``PagedKVCache`` whose free
blocks were fragmented at random, and compares its whole caches with a single-process reference (a per-token copy
into a clone of the initial caches): guard blocks (held by other sequences) and sentinel values stay bit-identical.
Requests are split at staging-grid boundaries (grid 8 tokens). Then, concurrently on disjoint ranks: a prefill rank
that stalls mid-request, one that is killed (SIGKILL) mid-request, and a layout mismatch at connect time.
Every process and the test itself stop by timeouts.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import tempfile
import time
import traceback
import unittest

import torch
import torch.multiprocessing as mp

import kvops  # imported once by the fork server (this module is preloaded), so the workers start without importing it

WORLD = 10
CONFIGS = [(4, 2, 8), (2, 4, 8), (1, 4, 2), (4, 1, 8), (8, 2, 2)]
LAYERS, BLOCK, HEAD_DIM, NUM_BLOCKS = 2, 4, 8, 24
CHUNK = 8  # chunked_prefill_size -> staging grid of 8 tokens (2 pages)
LENGTHS = {101: 21, 102: 8, 103: 0, 104: 5}  # request id -> tokens: 3 grid segments, exactly 1, none, a partial one
# (configuration i uses request ids 1000 * i + 101 ..., so its messages carry tags of their own)
SENTINEL = 7.0
FAULT_TIMEOUT_S = 4.0  # the receiver's deadline for each step of a request in the fault phases
SETUP_S = 180  # init and handshakes (connect(timeout_s=SETUP_S)): a loaded 2-core machine takes tens of seconds
TEST_TIMEOUT_S = 300


def full_kv(request_id: int, num_heads: int) -> torch.Tensor:
    """The request's synthetic KV over all heads: ``[2, L, n, H, D]`` bf16, N(0, 1) seeded by the request id."""
    g = torch.Generator().manual_seed(request_id)
    n = LENGTHS[request_id % 1000] if request_id < 10_000 else request_id % 100
    return torch.randn(2, LAYERS, n, num_heads, HEAD_DIM, generator=g).to(torch.bfloat16)


def prefill_caches(num_heads: int):
    return ([torch.full((NUM_BLOCKS, BLOCK, num_heads, HEAD_DIM), SENTINEL, dtype=torch.bfloat16)
             for _ in range(LAYERS)],
            [torch.full((NUM_BLOCKS, BLOCK, num_heads, HEAD_DIM), -SENTINEL, dtype=torch.bfloat16)
             for _ in range(LAYERS)])


def prefill_requests(k_caches, v_caches, lengths, total_heads, tp, rank, seed):
    """Write each request's local heads at a random permutation of blocks (kvops.paged_cache_write); returns the
    block tables."""
    from kvops.transfer import rank_head_range

    h0, h1 = rank_head_range(total_heads, tp, rank)
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = {}
    for rid, n in lengths.items():
        nb = -(-n // BLOCK)
        tables[rid], perm = torch.tensor(perm[:nb], dtype=torch.int32), perm[nb:]
        kv = full_kv(rid, total_heads)[..., h0:h1, :]
        pos = torch.arange(n)
        slots = tables[rid].long()[pos // BLOCK] * BLOCK + pos % BLOCK
        for layer in range(LAYERS):
            kvops.paged_cache_write(kv[0, layer], kv[1, layer], k_caches[layer], v_caches[layer], slots)
    return tables


def decode_cache(num_heads: int, seed: int):
    """A PagedKVCache with sentinel values whose free blocks are a random subset (fragmented, non-contiguous)."""
    from kvops.cache import PagedKVCache

    cache = PagedKVCache(NUM_BLOCKS, BLOCK, num_heads, HEAD_DIM, num_layers=LAYERS, dtype=torch.bfloat16)
    for c in cache.k_caches + cache.v_caches:
        c.fill_(SENTINEL).add_(torch.arange(NUM_BLOCKS).view(-1, 1, 1, 1))  # each block its own guard value
    for b in range(NUM_BLOCKS):
        cache.add_sequence(("guard", b))
        cache.extend(("guard", b), BLOCK)
    keep = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[: NUM_BLOCKS // 4].tolist()
    for b in range(NUM_BLOCKS):
        if b not in keep:
            cache.free(("guard", b))
    return cache


def reference_scatter(ref_k, ref_v, block_ids, kv_local):
    """Single-process reference: token p of layer l lands in block_ids[p // BLOCK], row p % BLOCK (all its heads)."""
    for p in range(kv_local.shape[2]):
        for layer in range(LAYERS):
            ref_k[layer][block_ids[p // BLOCK], p % BLOCK] = kv_local[0, layer, p]
            ref_v[layer][block_ids[p // BLOCK], p % BLOCK] = kv_local[1, layer, p]


def run_config(rank, index, cfg, decode_group, out):
    from kvops.transfer import (KVReceiver, KVSender, TransferGroups, compute_head_slice_params, rank_head_range,
                                writer_bytes)

    p_tp, d_tp, heads = cfg
    groups = TransferGroups(tuple(range(p_tp)), tuple(range(p_tp, p_tp + d_tp)))
    key = f"{p_tp},{d_tp},{heads}"
    lengths = {1000 * index + rid: n for rid, n in LENGTHS.items()}
    if rank < p_tp:
        local = max(1, heads // p_tp)
        k, v = prefill_caches(local)
        tables = prefill_requests(k, v, lengths, heads, p_tp, rank, seed=rank + 17)
        sender = KVSender(groups, rank, k, v, heads, chunked_prefill_size=CHUNK, timeout_s=20)
        sender.connect(timeout_s=SETUP_S)
        sent = {rid: sender.send(rid, n, tables[rid]).bytes_per_peer for rid, n in lengths.items()}
        out[key] = {"sent": {str(r % 1000): b for r, b in sent.items()}}
    elif rank < p_tp + d_tp:
        d = rank - p_tp
        local = max(1, heads // d_tp)
        cache = decode_cache(local, seed=rank * 31 + p_tp)
        ref_k = [c.clone() for c in cache.k_caches]
        ref_v = [c.clone() for c in cache.v_caches]
        recv = KVReceiver(groups, d, cache, heads, chunked_prefill_size=CHUNK, timeout_s=20,
                          decode_group=decode_group)
        recv.connect(timeout_s=SETUP_S)
        h0, h1 = rank_head_range(heads, d_tp, d)
        res = {"bytes_ok": True, "tables_non_contiguous": False}
        for rid, n in lengths.items():
            stats = recv.receive(rid, n)
            ids = cache.block_ids(rid)
            res["tables_non_contiguous"] |= any(b - a != 1 for a, b in zip(ids, ids[1:]))
            reference_scatter(ref_k, ref_v, ids, full_kv(rid, heads)[..., h0:h1, :])
            plan = {w.writer: writer_bytes(n, w.num_heads, HEAD_DIM * 2, LAYERS)
                    for w in compute_head_slice_params(p_tp, d_tp, d, heads)}
            res["bytes_ok"] &= stats.bytes_per_peer == plan
            res.setdefault("segments", {})[str(rid % 1000)] = stats.segments
        res["equal"] = all(torch.equal(a, b) for a, b in zip(cache.k_caches + cache.v_caches, ref_k + ref_v))
        res["ready"] = sorted(r % 1000 for r in recv.ready)
        res["writers"] = [w.writer for w in recv.writers]
        out[key] = res


def run_agreement(rank, pair_group, out):
    """Ranks 6,7 -> 8,9 (H=2, one writer each): prefill rank 7 never sends request 10_005, so decode rank 9 fails it;
    decode rank 8, which received its part, learns it through the decode group and releases the request too."""
    from kvops.transfer import KVReceiver, KVSender, KVTransferError, TransferGroups

    groups = TransferGroups((6, 7), (8, 9))
    lengths = {10_006: 6, 10_005: 5}
    if rank in (6, 7):
        k, v = prefill_caches(1)
        tables = prefill_requests(k, v, lengths, 2, 2, rank - 6, seed=rank)
        sender = KVSender(groups, rank - 6, k, v, 2, chunked_prefill_size=CHUNK, timeout_s=10)
        sender.connect(timeout_s=SETUP_S)
        for rid, n in lengths.items():
            if not (rank == 7 and rid == 10_005):
                sender.send(rid, n, tables[rid])
    else:
        cache = decode_cache(1, seed=rank)
        # rank 9 fails after its FAULT_TIMEOUT_S metadata deadline and only then votes; rank 8, which received its part
        # at once, waits in the agreement: with equal deadlines the two expire together and a loaded machine decides
        # which comes first (rank 8 then reports its own agreement timeout), so rank 8 waits three times as long
        timeout = FAULT_TIMEOUT_S * (3 if rank == 8 else 1)
        recv = KVReceiver(groups, rank - 8, cache, 2, chunked_prefill_size=CHUNK, timeout_s=timeout,
                          decode_group=pair_group)
        recv.connect(timeout_s=SETUP_S)
        recv.receive(10_006, lengths[10_006])
        free_before = cache.num_free_blocks
        try:
            recv.receive(10_005, lengths[10_005])
            out["agreement_error"] = None
        except KVTransferError as err:
            out["agreement_error"] = str(err)
        out["agreement_freed"] = cache.num_free_blocks == free_before and 10_005 not in cache.seq_ids
        out["agreement_ready"] = sorted(recv.ready)


def run_fault(rank, stall_released, out):
    """Ranks 0,1 -> 2: rank 1 stalls mid-request; ranks 3,4 -> 5: rank 4 is killed mid-request; 6 -> 7: mismatch."""
    import torch.distributed as dist

    from kvops.transfer import KVReceiver, KVSender, KVTransferError, TransferGroups

    lengths = {10_012: 12, 10_020: 20}  # 10_020: 3 segments; the faulty writer fails after its first
    if rank in (0, 1, 3, 4):
        base = 0 if rank < 2 else 3
        groups = TransferGroups((base, base + 1), (base + 2,))
        k, v = prefill_caches(1)
        tables = prefill_requests(k, v, lengths, 2, 2, rank - base, seed=rank)
        sender = KVSender(groups, rank - base, k, v, 2, chunked_prefill_size=CHUNK, timeout_s=FAULT_TIMEOUT_S * 4)
        sender.connect(timeout_s=SETUP_S)
        sender.send(10_012, lengths[10_012], tables[10_012])
        if rank in (1, 4):
            real = dist.batch_isend_irecv
            calls = []

            def faulty(ops):  # the writer's second KV message of request 10_020 (the first call: its metadata)
                calls.append(1)
                if len(calls) == 3:
                    if rank == 4:
                        os.kill(os.getpid(), signal.SIGKILL)  # dies mid-transfer
                    stall_released.wait(TEST_TIMEOUT_S)  # stalls until the decode side has given up
                return real(ops)

            dist.batch_isend_irecv = faulty
        try:
            sender.send(10_020, lengths[10_020], tables[10_020])
            out["sender_10_020"] = "ok"
        except KVTransferError as err:
            out["sender_10_020"] = "KVTransferError: " + str(err)[:200]
    elif rank in (2, 5):
        base = rank - 2
        groups = TransferGroups((base, base + 1), (rank,))
        cache = decode_cache(2, seed=rank)
        recv = KVReceiver(groups, 0, cache, 2, chunked_prefill_size=CHUNK, timeout_s=FAULT_TIMEOUT_S)
        recv.connect(timeout_s=SETUP_S)
        recv.receive(10_012, lengths[10_012])
        ids = cache.block_ids(10_012)
        snapshot = [c.clone() for c in cache.k_caches + cache.v_caches]
        free_before = cache.num_free_blocks
        t0 = time.perf_counter()
        try:
            recv.receive(10_020, lengths[10_020])
            out["error"] = None
        except KVTransferError as err:
            out["error"] = str(err)
        out["elapsed"] = time.perf_counter() - t0
        if rank == 2:
            stall_released.set()
        out["freed"] = cache.num_free_blocks == free_before and 10_020 not in cache.seq_ids
        out["ready"] = sorted(recv.ready)
        ref = full_kv(10_012, 2)
        held = sorted({b for seq in cache.seq_ids for b in cache.block_ids(seq)})  # the failed request's are free
        out["other_untouched"] = all(torch.equal(a[held], b[held])
                                     for a, b in zip(cache.k_caches + cache.v_caches, snapshot))
        out["other_correct"] = all(
            torch.equal(cache.k_caches[layer][ids[p // BLOCK], p % BLOCK], ref[0, layer, p])
            for p in range(lengths[10_012]) for layer in range(LAYERS))
    elif rank in (6, 7):
        groups = TransferGroups((6,), (7,))
        try:
            if rank == 6:
                k, v = prefill_caches(2)
                KVSender(groups, 0, k, v, 2, timeout_s=10).connect(timeout_s=SETUP_S)
            else:
                from kvops.cache import PagedKVCache

                cache = PagedKVCache(4, BLOCK, 2, HEAD_DIM * 2, num_layers=LAYERS, dtype=torch.bfloat16)
                KVReceiver(groups, 0, cache, 2, timeout_s=10).connect(timeout_s=SETUP_S)
            out["mismatch"] = None
        except ValueError as err:
            out["mismatch"] = str(err)


def save(outdir, rank, out):
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


KILLED = 4


def worker(rank, port, outdir, stall_released):
    out = {"times": [time.time()]}
    try:
        torch.set_num_threads(1)
        # kvops' native CPU kernels are not under test here: their first use builds the extension, or waits for the
        # build lock of the shared extension cache, which another process may hold for minutes (the handshakes then
        # time out); the composite kernels give the same bits
        os.environ["KVOPS_NATIVE"] = "0"
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=SETUP_S))
        decode_groups = [dist.new_group(list(range(p, p + d))) for p, d, _ in CONFIGS]
        pair_group = dist.new_group([8, 9])
        survivors = dist.new_group([r for r in range(WORLD) if r != KILLED])
        out["times"].append(time.time())
        for index, (cfg, group) in enumerate(zip(CONFIGS, decode_groups)):  # no barrier needed: tags differ
            run_config(rank, index, cfg, group if rank in range(cfg[0], cfg[0] + cfg[1]) else None, out)
            out["times"].append(time.time())
        out["times"].append(time.time())
        save(outdir, rank, out)  # before the fault phase, in which rank KILLED dies
        run_fault(rank, stall_released, out)
        if rank in (6, 7, 8, 9):
            run_agreement(rank, pair_group, out)
        out["times"].append(time.time())
        dist.barrier(group=survivors)  # nobody exits while a peer still completes a send to it
    except BaseException:  # reported to the parent test, which fails with the traceback
        out["exception"] = traceback.format_exc()
    save(outdir, rank, out)
    os._exit(0)  # no teardown: a peer was killed on purpose


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TestDistributedTransfer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # forkserver: one fresh server process imports torch and kvops once (this module is preloaded), then forks
        # the workers (importing kvops in 10 spawned processes costs ~30 s on 2 busy cores). The server has run no
        # tensor op, so no thread pool is forked.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        cls.tmp = tempfile.TemporaryDirectory()
        stall_released = ctx.Event()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, port, cls.tmp.name, stall_released)) for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + TEST_TIMEOUT_S
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        cls.exitcodes = [p.exitcode for p in procs]
        cls.results = {}
        for r in range(WORLD):
            path = os.path.join(cls.tmp.name, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    cls.results[r] = json.load(f)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def result(self, rank):
        self.assertIn(rank, self.results, f"rank {rank} wrote no result (exit codes {self.exitcodes})")
        res = self.results[rank]
        self.assertNotIn("exception", res, res.get("exception"))
        return res

    def test_configs_bit_identical(self):
        for p_tp, d_tp, heads in CONFIGS:
            key = f"{p_tp},{d_tp},{heads}"
            for d in range(d_tp):
                with self.subTest(config=key, decode_rank=d):
                    res = self.result(p_tp + d)[key]
                    self.assertTrue(res["equal"])
                    self.assertTrue(res["bytes_ok"])
                    self.assertTrue(res["tables_non_contiguous"])
                    self.assertEqual(res["ready"], sorted(LENGTHS))
                    self.assertEqual(res["segments"]["101"], [[0, 8], [8, 16], [16, 21]])
                    self.assertEqual(res["segments"]["103"], [[0, 0]])  # metadata only (as sglang)

    def test_no_duplicate_bytes_with_prefill_replication(self):
        # (8, 2, 2): each head lives on 4 prefill ranks; exactly one of them sends it to the decode rank needing it
        self.assertEqual(self.result(8)["8,2,2"]["writers"], [0])
        self.assertEqual(self.result(9)["8,2,2"]["writers"], [4])
        senders = [r for r in range(8) if any(any(b.values()) for b in self.result(r)["8,2,2"]["sent"].values())]
        self.assertEqual(senders, [0, 4])

    def test_stalled_prefill_rank(self):
        res = self.result(2)
        self.assertIn("prefill rank 1 (global rank 1) sent no data for tokens [8, 16): no message within 4 s",
                      res["error"])
        self.assertIn("Its blocks were released and it is not ready", res["error"])
        self.assertLess(res["elapsed"], FAULT_TIMEOUT_S + 3)
        self.assertTrue(res["freed"])
        self.assertEqual(res["ready"], [10_012])
        self.assertTrue(res["other_untouched"] and res["other_correct"])
        self.assertEqual(self.result(0)["sender_10_020"], "ok")  # the healthy writer was drained, not left hanging
        self.assertEqual(self.result(1)["sender_10_020"], "ok")  # the stalled one too, once resumed (discard buffers)

    def test_killed_prefill_rank(self):
        self.assertEqual(self.exitcodes[4], -signal.SIGKILL)
        res = self.result(5)
        self.assertIn("prefill rank 1 (global rank 4) sent no data for tokens [8, 16): connection failed", res["error"])
        self.assertLess(res["elapsed"], FAULT_TIMEOUT_S + 3)
        self.assertTrue(res["freed"])
        self.assertEqual(res["ready"], [10_012])
        self.assertTrue(res["other_untouched"] and res["other_correct"])
        self.assertEqual(self.result(3)["sender_10_020"], "ok")

    def test_decode_ranks_agree_on_failure(self):
        for rank, why in ((8, "another decode rank of the group failed to receive its part"),
                          (9, "prefill rank 1 (global rank 7) sent no metadata: no message within 4 s"),
                          ):
            res = self.result(rank)
            self.assertIn(f"KV transfer of request 10005 failed on decode rank {rank - 8}: {why}",
                          res["agreement_error"])
            self.assertTrue(res["agreement_freed"])
            self.assertEqual(res["agreement_ready"], [10_006])

    def test_layout_mismatch_rejected_at_connect(self):
        for rank in (6, 7):
            self.assertEqual(
                self.result(rank)["mismatch"],
                "KV transfer metadata mismatch: head_dim: prefill 8 vs decode 16. Both sides must serve the same "
                "model with the same KV cache layout (head_dim, dtype, page_size, layers, total KV heads); no KV "
                "was transferred.",
            )


if __name__ == "__main__":
    unittest.main()

"""KV transfer survives bad peers and bad requests (docs/transfer.md): gloo, CPU, spawned processes.

One world of 8 ranks, three groups run at once on disjoint ranks:
- ranks 0 -> 1 (one writer, one decode rank): a sequence of failing requests (out of blocks, duplicate id, more and
  fewer tokens than the decode rank expects, a half-size message, a writer stalling mid-request, a grid and a
  checksum-flag mismatch, a corrupted payload under ``checksum=True``), each followed by the receiver serving again;
  every failure raises ``KVTransferError`` (on both sides where both can know), frees the request's blocks and
  leaves the other requests' KV bit-identical; a request of 0 tokens completes with metadata only.
- ranks 2 -> 3, 4 with a decode group: decode rank 4 stalls in the agreement; rank 3 raises within the deadline.
- ranks 5 -> 6, 7 with a decode group: decode rank 7 is killed in the agreement; rank 6 raises ``KVTransferError``.
Set-up (process start, init, handshakes) has generous deadlines (a loaded 2-core machine takes tens of seconds);
the behaviour under test runs under the short ``STEP_S`` after a barrier of its group, so only the step is timed.
Every process and the test stop by themselves.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import tempfile
import time
import traceback
import unittest

import torch
import torch.multiprocessing as mp

from tests.transfer.test_transfer_dist import (CHUNK, decode_cache, free_port, full_kv, prefill_caches, prefill_requests,
                                      reference_scatter)

WORLD = 8
SETUP_S = 180  # process group init and the handshakes: generous, the machine may be loaded
STEP_S = 5.0  # the transfer endpoints' deadline for each step of a request under test
TEST_TIMEOUT_S = 240
KILLED = 7
# request id -> tokens is id % 100 (tests.transfer.test_transfer_dist.full_kv)
GOOD, LATE, ZERO = (20_012, 20_120, 20_708), 20_221, 20_300
OUT_OF_BLOCKS, MORE, FEWER, HALF, STALL, CORRUPT = 20_499, 20_512, 20_612, 20_812, 20_920, 21_012


def bits_equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def attempt(fn):
    """``("ok", result)`` or ``(type name, message)``."""
    try:
        return "ok", fn()
    except Exception as err:  # reported to the parent test, which checks the type and message
        return type(err).__name__, str(err)


def run_pair(rank, pair, released, out, flush):
    """Ranks 0 -> 1: each step first aligns both ranks (barrier), then runs under STEP_S."""
    import torch.distributed as dist

    from kvops.transfer import KVReceiver, KVSender, TransferGroups

    groups = TransferGroups((0,), (1,))
    step = lambda: dist.barrier(group=pair)  # noqa: E731
    good = {rid: rid % 100 for rid in GOOD + (ZERO, HALF, STALL, CORRUPT)}
    if rank == 0:
        k, v = prefill_caches(2)
        tables = prefill_requests(k, v, good, 2, 1, 0, seed=3)
        big = torch.zeros(25, dtype=torch.int32)  # a table covering 100 tokens
        sender = KVSender(groups, 0, k, v, 2, chunked_prefill_size=CHUNK, timeout_s=STEP_S)
        checked = KVSender(groups, 0, k, v, 2, chunked_prefill_size=CHUNK, timeout_s=STEP_S, checksum=True)
        coarse = KVSender(groups, 0, k, v, 2, chunked_prefill_size=2 * CHUNK, timeout_s=STEP_S)
        for endpoint in (sender, checked):  # the decode rank connects two endpoints; coarse does not connect
            endpoint.connect(timeout_s=SETUP_S)
        steps = [
            (sender, GOOD[0], good[GOOD[0]], tables[GOOD[0]]),
            (sender, OUT_OF_BLOCKS, 99, big),
            (sender, GOOD[0], good[GOOD[0]], tables[GOOD[0]]),  # a duplicate id on the decode rank
            (sender, MORE, 20, big),  # the decode rank expects 12 tokens
            (sender, FEWER, 6, big),  # the decode rank expects 12 tokens
            (sender, ZERO, 0, tables[ZERO]),
            (sender, HALF, good[HALF], tables[HALF]),  # sends half of each message
            (sender, STALL, good[STALL], tables[STALL]),  # stalls before its second segment
            (coarse, GOOD[1], 20, tables[GOOD[1]]),  # grid of 16 tokens vs the decode rank's 8
            (checked, GOOD[1], 20, tables[GOOD[1]]),  # checksum on vs off
            (checked, CORRUPT, good[CORRUPT], tables[CORRUPT]),  # a flipped bit in transit
            (checked, GOOD[1], good[GOOD[1]], tables[GOOD[1]]),
            (sender, GOOD[2], good[GOOD[2]], tables[GOOD[2]]),
        ]
        real = dist.batch_isend_irecv
        for endpoint, rid, n, table in steps:
            step()
            if rid in (HALF, STALL, CORRUPT):
                calls = []

                def faulty(ops, rid=rid):
                    calls.append(1)
                    if len(calls) >= 2:  # KV messages (the first call is the metadata exchange)
                        if rid == STALL and len(calls) == 3:
                            released.wait(TEST_TIMEOUT_S)  # until the decode rank has given up
                        if rid == HALF:
                            ops = [dist.P2POp(op.op, op.tensor[: op.tensor.numel() // 2], op.peer, tag=op.tag)
                                   for op in ops]
                        if rid == CORRUPT:
                            ops = [dist.P2POp(op.op, op.tensor.clone(), op.peer, tag=op.tag) for op in ops]
                            for op in ops:
                                op.tensor[3] ^= 0x10
                    return real(ops)

                dist.batch_isend_irecv = faulty
            t0 = time.perf_counter()
            outcome = attempt(lambda: endpoint.send(rid, n, table).bytes)
            dist.batch_isend_irecv = real
            out.setdefault("sent", []).append([rid, *outcome, time.perf_counter() - t0])
            flush()
    else:
        cache = decode_cache(2, seed=5)
        free0 = cache.num_free_blocks
        ref_k, ref_v = [c.clone() for c in cache.k_caches], [c.clone() for c in cache.v_caches]
        recv = KVReceiver(groups, 0, cache, 2, chunked_prefill_size=CHUNK, timeout_s=STEP_S)
        checked = KVReceiver(groups, 0, cache, 2, chunked_prefill_size=CHUNK, timeout_s=STEP_S, checksum=True)
        for endpoint in (recv, checked):
            endpoint.connect(timeout_s=SETUP_S)
        steps = [(recv, GOOD[0], 12), (recv, OUT_OF_BLOCKS, 99), (recv, GOOD[0], 12), (recv, MORE, 12),
                 (recv, FEWER, 12), (recv, ZERO, 0), (recv, HALF, 12), (recv, STALL, 20), (recv, GOOD[1], 20),
                 (recv, GOOD[1], 20), (checked, CORRUPT, 12), (checked, GOOD[1], 20), (recv, GOOD[2], 8)]
        for endpoint, rid, n in steps:
            step()
            held = {s: cache.block_ids(s) for s in cache.seq_ids}
            snapshot = [c.clone() for c in cache.k_caches + cache.v_caches]
            free_before = cache.num_free_blocks
            t0 = time.perf_counter()
            outcome = attempt(lambda: endpoint.receive(rid, n).segments)
            elapsed = time.perf_counter() - t0
            if rid == STALL:
                released.set()
            blocks = sorted({b for ids in held.values() for b in ids})
            out.setdefault("received", []).append([rid, *outcome, elapsed, {
                "freed": outcome[0] == "ok" or (cache.num_free_blocks == free_before and cache.seq_ids == list(held)),
                "others_untouched": all(torch.equal(a[blocks], b[blocks])
                                        for a, b in zip(cache.k_caches + cache.v_caches, snapshot)),
                "ready": rid in recv.ready or rid in checked.ready}])
            flush()
            if outcome[0] == "ok":
                reference_scatter(ref_k, ref_v, cache.block_ids(rid), full_kv(rid, 2))
        live = sorted({b for s in cache.seq_ids for b in cache.block_ids(s)})
        out["bit_exact"] = bits_equal([c[live] for c in cache.k_caches + cache.v_caches],
                                      [c[live] for c in ref_k + ref_v])
        out["seq_ids"] = [s for s in cache.seq_ids if isinstance(s, int)]
        out["free_blocks"] = [free0, cache.num_free_blocks]
        out["abandoned"] = len(recv._abandoned)


def run_agreement(rank, base, group, decode_group, released, out):
    """Ranks base -> base+1, base+2 (H=2: one head each) in a decode group: request LATE stalls (base 2) or kills
    (base 5) decode rank base+2 in the agreement; then GOOD[2] is received (base 2)."""
    import torch.distributed as dist

    from kvops.transfer import KVReceiver, KVSender, TransferGroups

    groups = TransferGroups((base,), (base + 1, base + 2))
    lengths = {rid: rid % 100 for rid in (GOOD[0], LATE, GOOD[2])}
    steps = [GOOD[0], LATE] + ([GOOD[2]] if base == 2 else [])
    if rank == base:
        k, v = prefill_caches(2)
        tables = prefill_requests(k, v, lengths, 2, 1, 0, seed=rank)
        sender = KVSender(groups, 0, k, v, 2, chunked_prefill_size=CHUNK, timeout_s=STEP_S)
        sender.connect(timeout_s=SETUP_S)
        for rid in steps:
            dist.barrier(group=group)
            outcome = attempt(lambda: sender.send(rid, lengths[rid], tables[rid]).bytes)
            out.setdefault("sent", []).append([rid, *outcome])
    else:
        cache = decode_cache(1, seed=rank)
        recv = KVReceiver(groups, rank - base - 1, cache, 2, chunked_prefill_size=CHUNK, timeout_s=STEP_S,
                          decode_group=decode_group)
        recv.connect(timeout_s=SETUP_S)
        real = dist.all_reduce
        for rid in steps:
            dist.barrier(group=group)
            if rid == LATE and rank == base + 2:
                def late(*args, **kwargs):
                    if base == 5:
                        os.kill(os.getpid(), signal.SIGKILL)  # dies in the agreement
                    released.wait(TEST_TIMEOUT_S)  # stalls until its peer has given up
                    return real(*args, **kwargs)

                dist.all_reduce = late
            free_before = cache.num_free_blocks
            t0 = time.perf_counter()
            outcome = attempt(lambda: recv.receive(rid, lengths[rid]).segments)
            elapsed = time.perf_counter() - t0
            dist.all_reduce = real
            if rid == LATE and rank == base + 1:
                released.set()
            out.setdefault("received", []).append([rid, *outcome, elapsed, cache.num_free_blocks == free_before
                                                   or outcome[0] == "ok", sorted(recv.ready)])


def save(outdir, rank, out):
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def worker(rank, port, outdir, released):
    out = {}
    try:
        torch.set_num_threads(1)
        # kvops' native CPU kernels are not under test here: their first use builds the extension, or waits for the
        # build lock of the shared extension cache, which another process may hold for minutes (the handshakes then
        # time out); the composite kernels give the same bits
        os.environ["KVOPS_NATIVE"] = "0"
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=SETUP_S))
        groups = [dist.new_group(list(r)) for r in ((0, 1), (2, 3, 4), (5, 6, 7), (3, 4), (6, 7))]
        survivors = dist.new_group([r for r in range(WORLD) if r != KILLED])
        if rank in (0, 1):
            run_pair(rank, groups[0], released[0], out, lambda: save(outdir, rank, out))
        elif rank in (2, 3, 4):
            run_agreement(rank, 2, groups[1], groups[3], released[1], out)
        else:
            run_agreement(rank, 5, groups[2], groups[4], released[2], out)
        save(outdir, rank, out)
        dist.barrier(group=survivors)  # nobody exits while a peer still completes a send to it
    except BaseException:  # reported to the parent test, which fails with the traceback
        out["exception"] = traceback.format_exc()
    save(outdir, rank, out)
    os._exit(0)  # no teardown: a peer was killed on purpose


class TestTransferFaults(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        ctx = mp.get_context("forkserver")  # one server imports torch and kvops once, then forks the ranks
        ctx.set_forkserver_preload([__name__])
        cls.tmp = tempfile.TemporaryDirectory()
        released = [ctx.Event() for _ in range(3)]
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, port, cls.tmp.name, released)) for r in range(WORLD)]
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

    def steps(self):
        sent, received = self.result(0)["sent"], self.result(1)["received"]
        self.assertEqual(len(sent), len(received))
        return list(zip(sent, received))

    def assert_failed(self, index, decode_why, prefill_why=None, ready=False):
        """Step ``index`` raised KVTransferError naming ``decode_why`` on the decode rank (and ``prefill_why`` on the
        prefill rank, or the prefill rank succeeded when None), freed its blocks, touched no other request's KV
        (``ready``: the id is still ready from an earlier request of that id)."""
        (rid, kind, msg, _), (rid2, rkind, rmsg, elapsed, facts) = self.steps()[index]
        self.assertEqual(rid, rid2)
        self.assertEqual(rkind, "KVTransferError", rmsg)
        self.assertIn(f"KV transfer of request {rid} failed on decode rank 0: ", rmsg)
        self.assertIn(decode_why, rmsg)
        self.assertIn("Its blocks were released and it is not ready", rmsg)
        self.assertEqual(facts, {"freed": True, "others_untouched": True, "ready": ready})
        self.assertLess(elapsed, STEP_S * 2 + 2)
        if prefill_why is None:
            self.assertEqual(kind, "ok", msg)
        else:
            self.assertEqual(kind, "KVTransferError", msg)
            self.assertIn(f"KV transfer of request {rid} failed on prefill rank 0: decode rank 0 (global rank 1): ",
                          msg)
            self.assertIn(prefill_why, msg)

    def assert_ok(self, index, segments):
        (rid, kind, msg, _), (rid2, rkind, rsegments, _, facts) = self.steps()[index]
        self.assertEqual((kind, rkind), ("ok", "ok"), (msg, rsegments))
        self.assertEqual(rsegments, segments)
        self.assertTrue(facts["ready"])

    def test_good_requests_before_and_after_failures(self):
        self.assert_ok(0, [[0, 8], [8, 12]])
        self.assert_ok(11, [[0, 8], [8, 16], [16, 20]])  # the checksum endpoints
        self.assert_ok(12, [[0, 8]])
        res = self.result(1)
        self.assertTrue(res["bit_exact"])  # every ready request's KV, and the guard blocks, against the reference
        self.assertEqual(res["seq_ids"], [GOOD[0], ZERO, GOOD[1], GOOD[2]])

    def test_out_of_blocks(self):
        self.assert_failed(1, "its 99 tokens could not be placed (PagedKVCache: out of blocks",
                           "it refused the request: its tokens could not be placed in the decode rank's cache")

    def test_duplicate_request_id(self):
        # the request already held under that id stays as it was (ready, its KV untouched)
        self.assert_failed(2, f"could not be placed (PagedKVCache: sequence {GOOD[0]} already exists",
                           "it refused the request: its tokens could not be placed", ready=True)

    def test_token_count_mismatch(self):
        # more tokens than expected: both raise, the decode process survives (gloo aborted it before)
        self.assert_failed(3, "prefill rank 0 (global rank 0) disagrees on the request's metadata: num_tokens: "
                              "prefill 20 vs decode 12; payload_bytes: prefill 2560 vs decode 1536",
                           "it refused the request: its metadata differs (num_tokens: prefill 20 vs decode 12; "
                           "payload_bytes: prefill 2560 vs decode 1536)")
        self.assert_failed(4, "num_tokens: prefill 6 vs decode 12", "num_tokens: prefill 6 vs decode 12")

    def test_zero_tokens_is_metadata_only(self):
        self.assert_ok(5, [[0, 0]])

    def test_half_size_message(self):
        self.assert_failed(6, "prefill rank 0 (global rank 0) sent a bad message for tokens [0, 8): the message is "
                              "shorter than agreed (its end marker did not arrive)")

    def test_stall_on_multi_segment_request(self):
        self.assert_failed(7, f"prefill rank 0 (global rank 0) sent no data for tokens [8, 16): no message within "
                              f"{STEP_S:g} s")
        self.assertEqual(self.result(0)["sent"][7][1], "ok")  # drained once it resumed (discard buffers)

    def test_grid_and_checksum_flag_mismatch(self):
        self.assert_failed(8, "grid_tokens: prefill 16 vs decode 8", "grid_tokens: prefill 16 vs decode 8")
        self.assert_failed(9, "checksum: prefill on vs decode off", "checksum: prefill on vs decode off")

    def test_corrupted_payload_with_checksum(self):
        self.assert_failed(10, "sent a bad message for tokens [0, 8): the payload checksum does not match")

    def test_blocks_accounting(self):
        free0, free1 = self.result(1)["free_blocks"]
        self.assertEqual(free0 - free1, 3 + 0 + 5 + 2)  # held: 12, 0, 20 and 8 tokens in blocks of 4

    def test_stalled_decode_peer(self):
        res = self.result(3)["received"]
        self.assertEqual(res[0][1], "ok")
        rid, kind, msg, elapsed, freed, ready = res[1]
        self.assertEqual(kind, "KVTransferError")
        self.assertIn(f"KV transfer of request {LATE} failed on decode rank 0: the decode ranks of decode_group did "
                      f"not agree on the outcome (no message within {STEP_S:g} s; a decode rank stalled or died)", msg)
        self.assertLess(elapsed, STEP_S * 3 + 2)  # the metadata, the segments, the agreement: bounded, not the stall
        self.assertTrue(freed)
        self.assertEqual(res[2][1], "ok")  # and it keeps serving
        self.assertEqual(self.result(4)["received"][2][1], "ok")

    def test_killed_decode_peer(self):
        self.assertEqual(self.exitcodes[KILLED], -signal.SIGKILL)
        rid, kind, msg, elapsed, freed, ready = self.result(6)["received"][1]
        self.assertEqual(kind, "KVTransferError", msg)
        self.assertIn("the decode ranks of decode_group did not agree on the outcome", msg)
        self.assertLess(elapsed, STEP_S * 3 + 2)
        self.assertTrue(freed)
        self.assertEqual(ready, [GOOD[0]])


if __name__ == "__main__":
    unittest.main()

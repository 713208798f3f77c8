"""A malformed transfer message is refused, not fatal (docs/transfer.md): gloo, CPU, two spawned processes.

Before, a message longer than the receive posted for it (random bytes, or a header of another layout where a header
was expected) aborted the receiving process inside gloo (``gloo::EnforceNotMet ... Received data size doesn't match
expected size``, SIGABRT): one buggy or differently-versioned peer took a decode server down. Now every handshake
record, header and answer travels as a fixed 4 KiB frame (``kvops.transfer.wire``), received into a buffer of that
size, so a message up to 4 KiB of any content is refused with ``KVTransferError`` naming why, and both endpoints
keep serving.

Rank 0 (prefill) misbehaves by hand with raw ``torch.distributed`` sends, then runs a ``KVSender``; rank 1 (decode)
runs a ``KVReceiver``, then misbehaves by hand towards the sender. Set-up has a generous deadline, each step
``STEP_S``; both processes and the test stop by themselves.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
import traceback
import unittest

import torch
import torch.multiprocessing as mp

from tests.transfer.test_transfer_dist import CHUNK, decode_cache, free_port, prefill_caches, prefill_requests

SETUP_S = 120
STEP_S = 5.0
TEST_TIMEOUT_S = 200
HALF, NOISE, V1, GOOD, BAD_ANSWER, AFTER = 30_012, 30_112, 30_212, 30_312, 30_412, 30_508  # tokens: id % 100


def attempt(fn):
    try:
        return ["ok", fn()]
    except Exception as err:  # reported to the parent test, which checks the type and message
        return [type(err).__name__, str(err)]


def noise(nbytes, seed):
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def prefill(out):
    import torch.distributed as dist

    from kvops.transfer import KVSender, TransferGroups, wire
    from kvops.transfer.transport import _HANDSHAKE_TAG

    sender = KVSender(TransferGroups((0,), (1,)), 0, *caches_for_prefill(), 2, chunked_prefill_size=CHUNK,
                      timeout_s=STEP_S)
    k, v = sender.k_caches, sender.v_caches
    tables = prefill_requests(k, v, {GOOD: 12, BAD_ANSWER: 12, AFTER: 8}, 2, 1, 0, seed=3)
    dist.barrier()
    # the handshake: 100 random bytes instead of the layout record, then the real one
    dist.send(noise(100, 0), 1, tag=_HANDSHAKE_TAG)
    dist.recv(wire.empty_frame("cpu"), 1, tag=_HANDSHAKE_TAG)
    dist.barrier()
    sender.connect(timeout_s=SETUP_S)
    frame = sender._header(HALF, 12, 0, 2, 0)
    for rid, message in ((HALF, frame.view(torch.uint8)[: frame.numel() * 4]),  # half a header
                         (NOISE, noise(1000, 1)),  # random bytes
                         (V1, torch.tensor([wire.MAGIC, 1] + [0] * 11))):  # a version-1 header (13 words)
        dist.barrier()
        dist.send(message, 1, tag=rid)
        answer = wire.empty_frame("cpu")
        dist.recv(answer, 1, tag=rid)  # the decode rank answers with its refusal
        out.setdefault("answers", []).append(wire.decode(answer)[0]["status"])
    for rid in (GOOD, BAD_ANSWER, AFTER):
        dist.barrier()
        out.setdefault("sent", []).append([rid, *attempt(lambda: sender.send(rid, rid % 100, tables[rid]).bytes)])


def caches_for_prefill():
    return prefill_caches(2)


def decode(out):
    import torch.distributed as dist

    from kvops.transfer import KVReceiver, TransferGroups

    cache = decode_cache(2, seed=5)
    free = cache.num_free_blocks
    receiver = KVReceiver(TransferGroups((0,), (1,)), 0, cache, 2, chunked_prefill_size=CHUNK, timeout_s=STEP_S)
    dist.barrier()
    out["handshake"] = attempt(lambda: receiver.connect(timeout_s=SETUP_S))
    dist.barrier()
    receiver.connect(timeout_s=SETUP_S)
    for rid in (HALF, NOISE, V1, GOOD):
        dist.barrier()
        outcome = attempt(lambda: receiver.receive(rid, rid % 100).segments)
        out.setdefault("received", []).append([rid, *outcome, cache.num_free_blocks - free])
        if rid == GOOD:
            cache.free(GOOD)
    dist.barrier()  # BAD_ANSWER: take the sender's header, answer with random bytes
    from kvops.transfer import wire

    dist.recv(wire.empty_frame("cpu"), 0, tag=BAD_ANSWER)
    dist.send(noise(100, 2), 0, tag=BAD_ANSWER)
    dist.barrier()
    outcome = attempt(lambda: receiver.receive(AFTER, AFTER % 100).segments)
    out.setdefault("received", []).append([AFTER, *outcome, cache.num_free_blocks - free])
    out["ready"] = sorted(receiver.ready)


def worker(rank, port, outdir):
    out = {}
    try:
        torch.set_num_threads(1)
        os.environ["KVOPS_NATIVE"] = "0"  # as tests/transfer/test_transfer_faults.py: no native build inside the deadlines
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=SETUP_S))
        (prefill if rank == 0 else decode)(out)
        dist.barrier()
    except BaseException:  # reported to the parent test, which fails with the traceback
        out["exception"] = traceback.format_exc()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    os._exit(0)


class TestMalformedMessages(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        cls.tmp = tempfile.TemporaryDirectory()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, port, cls.tmp.name)) for r in range(2)]
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
        for r in range(2):
            path = os.path.join(cls.tmp.name, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    cls.results[r] = json.load(f)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def result(self, rank):
        self.assertEqual(self.exitcodes, [0, 0], "a process died (SIGABRT is -6)")
        res = self.results[rank]
        self.assertNotIn("exception", res, res.get("exception"))
        return res

    def test_junk_handshake_is_refused_then_a_real_one_connects(self):
        kind, msg = self.result(1)["handshake"]
        self.assertEqual(kind, "KVTransferError", msg)
        self.assertIn("KV transfer handshake of decode rank 0 with peer rank 0 failed: it sent not a kvops v2 "
                      "transfer message", msg)

    def test_malformed_headers_are_refused_and_the_receiver_keeps_serving(self):
        received = {r[0]: r[1:] for r in self.result(1)["received"]}
        for rid, why in ((HALF, "a malformed kvops message (shorter or longer than the 4096-byte frame"),
                         (NOISE, "not a kvops v2 transfer message"),
                         (V1, "not a kvops v2 transfer message (magic 0x4b564f5053, version 1")):
            kind, msg, held = received[rid]
            self.assertEqual(kind, "KVTransferError", msg)
            self.assertIn(f"KV transfer of request {rid} failed on decode rank 0: prefill rank 0 (global rank 0) "
                          f"sent {why}", msg)
            self.assertIn("instead of the request's metadata", msg)
            self.assertEqual(held, 0)  # its blocks were released
        self.assertEqual(self.result(0)["answers"], [2, 2, 2])  # refused: "its metadata differs"
        self.assertEqual(received[GOOD][:2], ["ok", [[0, 8], [8, 12]]])
        self.assertEqual(received[AFTER][:2], ["ok", [[0, 8]]])
        self.assertEqual(self.result(1)["ready"], [GOOD, AFTER])

    def test_malformed_answer_is_refused_and_the_sender_keeps_serving(self):
        sent = {r[0]: r[1:] for r in self.result(0)["sent"]}
        self.assertEqual(sent[GOOD][0], "ok")
        kind, msg = sent[BAD_ANSWER]
        self.assertEqual(kind, "KVTransferError", msg)
        self.assertIn(f"KV transfer of request {BAD_ANSWER} failed on prefill rank 0: decode rank 0 (global rank 1): "
                      f"its answer to the request's metadata is not a kvops v2 transfer message", msg)
        self.assertEqual(sent[AFTER][0], "ok")


if __name__ == "__main__":
    unittest.main()

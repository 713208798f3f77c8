"""Decode side of the KV transfer: :class:`KVReceiver` (protocol: :mod:`kvops.transfer.transport`)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..ops.transfer import paged_kv_scatter
from . import wire
from .routing import check_transfer_metadata, compute_grid_segments, compute_head_slice_params
from .transport import KVTransferError, TransferGroups, TransferStats, _check_request, _Endpoint


class KVReceiver(_Endpoint):
    """Decode side: receives requests' KV into a ``kvops.PagedKVCache`` (its layers' caches, this rank's heads).

    Args:
        groups, tp_rank: as :class:`KVSender` (``tp_rank`` indexes ``groups.decode_ranks``).
        cache: the decode rank's ``PagedKVCache`` (``num_kv_heads = max(1, H // D_tp)``); blocks are allocated per
            request in :meth:`receive`.
        total_kv_heads, chunked_prefill_size, timeout_s, checksum: as :class:`KVSender` (must match the senders;
            the per-request metadata exchange checks it).
        decode_group: optional process group of the decode ranks; then a request is ready only if every decode rank
            received its part (one ``all_reduce`` per request, under the ``timeout_s`` deadline).

    Attributes:
        ready: ids of the requests whose KV is complete on this rank (and, with ``decode_group``, on all).
        writers: ``compute_head_slice_params(P_tp, D_tp, tp_rank, H)``, the staging buffer's writer order.
    """

    side = "decode"

    def __init__(self, groups: TransferGroups, tp_rank: int, cache, total_kv_heads: int, *,
                 chunked_prefill_size: int | None = 8192, timeout_s: float = 30.0, checksum: bool = False,
                 decode_group=None) -> None:
        super().__init__(groups, tp_rank, cache.k_caches, cache.v_caches, total_kv_heads, chunked_prefill_size,
                         timeout_s, checksum)
        self.cache = cache
        self.decode_group = decode_group
        self.writers = compute_head_slice_params(self.prefill_tp, self.decode_tp, tp_rank, total_kv_heads)
        self.ready: set[int] = set()
        self._dead: set[int] = set()  # writers whose connection failed (closed or timed out): never waited on again

    def connect(self, timeout_s: float | None = None) -> None:
        """Exchange layouts with every writer; ``ValueError`` on any mismatch (no KV moves). ``timeout_s``: as
        :meth:`KVSender.connect`."""
        for theirs in self._handshake([s.writer for s in self.writers], self.groups.prefill_ranks, timeout_s):
            check_transfer_metadata(theirs, self.kv_args)

    def _who(self, writer: int) -> str:
        return f"prefill rank {writer} (global rank {self.groups.prefill_ranks[writer]})"

    def receive(self, request_id: int, num_tokens: int) -> TransferStats:
        """Allocate the request's blocks (sequence id ``request_id``), receive and scatter its KV, mark it ready.

        Raises ``ValueError`` (nothing allocated or exchanged) for a bad ``request_id`` or ``num_tokens``, and
        ``KVTransferError`` (the request's blocks freed, it is not ready; the receiver keeps serving) when the
        cache is out of blocks or already holds ``request_id``, a writer's metadata differs (token count, layers,
        heads, dtype, bytes, grid, checksum flag: the writer raises too, and no KV moves), a writer is dead or
        stalls past ``timeout_s``, a message arrives short, out of order or (``checksum=True``) corrupted, or
        (with ``decode_group``) another decode rank failed or did not agree in time.
        """
        _check_request(request_id, num_tokens)
        t0 = time.perf_counter()
        segments = compute_grid_segments(0, num_tokens, 0, self.grid_tokens)
        stats = TransferStats(request_id, num_tokens, segments, {s.writer: 0 for s in self.writers})
        added = False
        try:
            status, failure = wire.STATUS_OK, None
            try:
                self.cache.add_sequence(request_id)
                added = True
                self.cache.extend(request_id, num_tokens)
            except (RuntimeError, ValueError) as err:  # OutOfBlocksError, duplicate id: refuse before any KV moves
                status, failure = 1, f"its {num_tokens} tokens could not be placed ({err})"
            agreed = self._agree(request_id, num_tokens, status)
            failure = failure or agreed
            if failure is None:
                block_table = torch.tensor(self.cache.block_ids(request_id), dtype=torch.int32, device=self.device)
                for index, (s, e) in enumerate(segments):
                    failure = self._segment(request_id, index, s, e, block_table, stats)
                    if failure is not None:  # drain the rest: writers' messages go to discard buffers
                        for s2, e2 in segments[index + 1 :]:
                            self._drain(request_id, s2, e2)
                        break
            failure = self._agreement(failure)
        except BaseException:
            if added and request_id in self.cache.seq_ids:
                self.cache.free(request_id)
            raise
        stats.seconds = time.perf_counter() - t0
        if failure is not None:
            if added:
                self.cache.free(request_id)
            raise KVTransferError(
                f"KV transfer of request {request_id} failed on decode rank {self.tp_rank}: {failure}. Its blocks "
                f"were released and it is not ready; other requests' KV is untouched."
            )
        self.ready.add(request_id)
        return stats

    def _expected(self, request_id: int, num_tokens: int, status: int) -> list[torch.Tensor]:
        return [self._header(request_id, num_tokens, self.head_offset + w.cache_head_start, w.num_heads, status)
                for w in self.writers]

    def _agree(self, request_id: int, num_tokens: int, status: int) -> str | None:
        """The metadata step: receive each live writer's header, answer each with what this rank expects and the
        verdict; returns why the request fails here (``None``: agreed, KV follows)."""
        live = [i for i, w in enumerate(self.writers) if w.writer not in self._dead]
        failure = None
        if len(live) < len(self.writers):
            failure = f"prefill ranks {sorted(self._dead)} are gone (their connections failed earlier)"
        expected = self._expected(request_id, num_tokens, status)
        headers = {i: wire.empty_frame(self.device) for i in live}
        works, posting = self._post([dist.P2POp(dist.irecv, headers[i], self.groups.prefill_ranks[
            self.writers[i].writer], tag=request_id) for i in live])
        reasons = [posting] * len(live) if posting else self._wait(works, [headers[i] for i in live])
        arrived, mismatch = [], False
        for i, reason in zip(live, reasons):
            w = self.writers[i]
            if reason is not None:
                if reason.startswith("connection failed"):
                    self._dead.add(w.writer)
                failure = failure or f"{self._who(w.writer)} sent no metadata: {reason}"
                continue
            arrived.append(i)
            theirs, malformed = wire.decode(headers[i])
            if malformed:
                mismatch = True
                failure = failure or f"{self._who(w.writer)} sent {malformed} instead of the request's metadata"
                continue
            diffs = wire.differences(theirs, wire.decode(expected[i])[0])
            if diffs:
                mismatch = True
                failure = failure or f"{self._who(w.writer)} disagrees on the request's metadata: {'; '.join(diffs)}"
        if failure is not None and status == wire.STATUS_OK:
            status = 2 if mismatch else 3
        answers = self._expected(request_id, num_tokens, status)
        ops = [dist.P2POp(dist.isend, answers[i], self.groups.prefill_ranks[self.writers[i].writer], tag=request_id)
               for i in live if self.writers[i].writer not in self._dead]
        works, posting = self._post(ops)
        if posting is None:  # answers to writers whose header arrived complete at once; others' when they resume
            done = [k for k, op in enumerate(ops) if any(op.tensor is answers[i] for i in arrived)]
            for reason in self._wait([works[k] for k in done], [ops[k].tensor for k in done]):
                failure = failure or (None if reason is None else f"answering the writers failed ({reason})")
            self._keep([w for k, w in enumerate(works) if k not in done],
                       [op.tensor for k, op in enumerate(ops) if k not in done])
        return failure or posting

    def _segment(self, request_id, index, s, e, block_table, stats) -> str | None:
        """Receive, check and scatter one segment from every writer; returns why it failed (``None``: done)."""
        msgs = [self._message(e - s, w.num_heads) for w in self.writers]
        for buf, payload, _ in msgs:
            wire.arm(buf, payload)
        works, posting = self._post([dist.P2POp(dist.irecv, msgs[i][0], self.groups.prefill_ranks[w.writer],
                                                tag=request_id) for i, w in enumerate(self.writers)])
        if posting is not None:
            self._dead.update(w.writer for w in self.writers)
            return f"posting receives for tokens [{s}, {e}) failed ({posting})"
        failure = None
        for (buf, payload, _), w, reason in zip(msgs, self.writers, self._wait(works, [m[0] for m in msgs])):
            if reason is None:
                reason = wire.check(buf, payload, request_id, index, self.checksum)
                if reason is None:
                    stats.bytes_per_peer[w.writer] += payload
                    continue
                failure = failure or f"{self._who(w.writer)} sent a bad message for tokens [{s}, {e}): {reason}"
                continue
            if reason.startswith("connection failed"):
                self._dead.add(w.writer)
            failure = failure or f"{self._who(w.writer)} sent no data for tokens [{s}, {e}): {reason}"
        if failure is None and e > s:  # every writer's slice arrived whole: write them into the request's pages
            for (_, _, staging), w in zip(msgs, self.writers):
                paged_kv_scatter(staging, self.k_caches, self.v_caches, block_table, s, w.cache_head_start)
        return failure

    def _drain(self, request_id, s, e) -> None:
        """Post a failed request's remaining receives into discard buffers (never waited on), so that the writers'
        sends complete."""
        live = [w for w in self.writers if w.writer not in self._dead]
        msgs = [self._message(e - s, w.num_heads)[0] for w in live]
        works, posting = self._post([dist.P2POp(dist.irecv, buf, self.groups.prefill_ranks[w.writer],
                                                tag=request_id) for buf, w in zip(msgs, live)])
        if posting is None:
            self._keep(works, msgs)

    def _agreement(self, failure: str | None) -> str | None:
        """With ``decode_group``: every decode rank's outcome (MIN of ok flags), within ``timeout_s``."""
        if self.decode_group is None:
            return failure
        ok = torch.tensor([0 if failure else 1], dtype=torch.int32, device=self.device)
        try:
            work = dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.decode_group, async_op=True)
            reason = self._wait([work], [ok])[0]
        except RuntimeError as err:
            reason = f"connection failed: {err}"
        if reason is not None:
            return failure or (f"the decode ranks of decode_group did not agree on the outcome ({reason}; a decode "
                               f"rank stalled or died)")
        if failure is None and int(ok) == 0:
            return "another decode rank of the group failed to receive its part"
        return failure

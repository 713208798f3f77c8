"""Prefill side of the KV transfer: :class:`KVSender` (protocol: :mod:`kvops.transfer.transport`)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..ops.transfer import paged_kv_gather
from . import wire
from .routing import check_transfer_metadata, compute_grid_segments, routes_for_writer
from .transport import KVTransferError, TransferGroups, TransferStats, _check_request, _Endpoint


class KVSender(_Endpoint):
    """Prefill side: sends one request's KV (its head slices, all layers) to the decode ranks its routes name.

    Args:
        groups: the world's prefill and decode ranks. tp_rank: this rank's index in ``groups.prefill_ranks``.
        k_caches, v_caches: this rank's ``L`` paged caches ``[P, block_size, H // P_tp (or 1), D]`` each.
        total_kv_heads: ``H`` (see ``resolve_total_kv_heads``). chunked_prefill_size: staging grid size in tokens
            (rounded to whole pages; ``None``: 8192, sglang's default). timeout_s: seconds each step (the
            handshake, the metadata exchange, each segment's messages) may take. checksum: send a checksum of each
            message's payload (the decode ranks must set it too; it is part of the per-request metadata).
    """

    side = "prefill"

    def __init__(self, groups: TransferGroups, tp_rank: int, k_caches, v_caches, total_kv_heads: int, *,
                 chunked_prefill_size: int | None = 8192, timeout_s: float = 30.0, checksum: bool = False) -> None:
        super().__init__(groups, tp_rank, k_caches, v_caches, total_kv_heads, chunked_prefill_size, timeout_s,
                         checksum)
        self.targets = routes_for_writer(self.prefill_tp, self.decode_tp, tp_rank, total_kv_heads)
        self._slices = sorted({(s.src_head_start, s.num_heads) for _, s in self.targets})

    def connect(self, timeout_s: float | None = None) -> None:
        """Exchange layouts with every decode rank this rank writes to; ``ValueError`` on any mismatch.
        ``timeout_s``: the handshake's deadline (default: the endpoint's; start-up may deserve a longer one)."""
        peers = sorted({d for d, _ in self.targets})
        for theirs in self._handshake(peers, self.groups.decode_ranks, timeout_s):
            check_transfer_metadata(self.kv_args, theirs)

    def send(self, request_id: int, num_tokens: int, block_table: torch.Tensor) -> TransferStats:
        """Send tokens ``[0, num_tokens)`` of the request whose pages are ``block_table`` (1-D int32/int64).

        First agrees with every target decode rank on the request's metadata; then sends to each one that agreed.
        Raises ``ValueError`` (nothing sent) for a bad ``request_id``/``num_tokens`` or a ``block_table`` too short
        for ``num_tokens``; ``KVTransferError`` when a decode rank refused the request (its metadata differs, it
        could not place it), is gone, or does not answer or receive within ``timeout_s``.
        """
        _check_request(request_id, num_tokens)
        capacity = block_table.shape[0] * self.block_size if block_table.dim() == 1 else -1
        if capacity < num_tokens:
            raise ValueError(
                f"KVSender.send: block_table of shape {tuple(block_table.shape)} covers {max(capacity, 0)} tokens "
                f"(block_size {self.block_size}) but num_tokens={num_tokens}; pass the request's 1-D block table."
            )
        t0 = time.perf_counter()
        segments = compute_grid_segments(0, num_tokens, 0, self.grid_tokens)
        stats = TransferStats(request_id, num_tokens, segments, {d: 0 for d, _ in self.targets})
        failed = self._agree(request_id, num_tokens)
        targets = [(d, sl) for d, sl in self.targets if d not in failed]
        for index, (s, e) in enumerate(segments):
            msgs = {}
            for h0, nh in self._slices:  # one gather per distinct slice, sent to every decode rank needing it
                if any((sl.src_head_start, sl.num_heads) == (h0, nh) for _, sl in targets):
                    buf, payload, staging = self._message(e - s, nh)
                    if e > s:
                        paged_kv_gather(self.k_caches, self.v_caches, block_table, staging, s, h0)
                    wire.seal(buf, payload, request_id, index, self.checksum)
                    msgs[h0, nh] = buf, payload
            sends = [msgs[sl.src_head_start, sl.num_heads][0] for _, sl in targets]
            works, posting = self._post([dist.P2POp(dist.isend, buf, self.groups.decode_ranks[d], tag=request_id)
                                         for (d, _), buf in zip(targets, sends)])
            reasons = [posting] * len(sends) if posting else self._wait(works, sends)
            for (d, sl), reason in zip(list(targets), reasons):
                if reason is None:
                    stats.bytes_per_peer[d] += msgs[sl.src_head_start, sl.num_heads][1]
                else:
                    failed[d] = f"sending tokens [{s}, {e}) did not complete ({reason})"
                    targets.remove((d, sl))
        stats.seconds = time.perf_counter() - t0
        if failed:
            d, why = min(failed.items())
            raise KVTransferError(
                f"KV transfer of request {request_id} failed on prefill rank {self.tp_rank}: decode rank {d} "
                f"(global rank {self.groups.decode_ranks[d]}): {why}."
                + (f" Also failed: decode ranks {sorted(failed)[1:]}." if len(failed) > 1 else "")
            )
        return stats

    def _agree(self, request_id: int, num_tokens: int) -> dict[int, str]:
        """The metadata step: send each target the header, receive its answer; returns the targets that refused
        (or did not answer) with why."""
        mine = {d: self._header(request_id, num_tokens, self.head_offset + sl.src_head_start, sl.num_heads, 0)
                for d, sl in self.targets}
        answers = {d: wire.empty_frame(self.device) for d in mine}
        ops, bufs = [], []
        for d, h in mine.items():
            peer = self.groups.decode_ranks[d]
            ops += [dist.P2POp(dist.isend, h, peer, tag=request_id), dist.P2POp(dist.irecv, answers[d], peer,
                                                                                tag=request_id)]
            bufs += [h, answers[d]]
        works, posting = self._post(ops)
        reasons = [posting] * len(ops) if posting else self._wait(works, bufs)
        failed = {}
        for i, d in enumerate(mine):
            reason = reasons[2 * i] or reasons[2 * i + 1]
            if reason is not None:
                failed[d] = f"no answer to the request's metadata ({reason})"
                continue
            theirs, malformed = wire.decode(answers[d])
            if malformed:
                failed[d] = f"its answer to the request's metadata is {malformed}"
                continue
            diffs = wire.differences(wire.decode(mine[d])[0], theirs)
            if diffs or theirs["status"] != wire.STATUS_OK:
                why = wire.REFUSALS.get(theirs["status"], f"status {theirs['status']}")
                failed[d] = f"it refused the request: {why}" + (f" ({'; '.join(diffs)})" if diffs else "")
        return failed

"""Prefill→decode KV transfer over ``torch.distributed`` point-to-point (gloo on CPU, NCCL on GPU).

The protocol and the parts both endpoints share; the endpoints are :class:`~kvops.transfer.sender.KVSender`
(``sender.py``) and :class:`~kvops.transfer.receiver.KVReceiver` (``receiver.py``).

One world holds a prefill TP group and a decode TP group (their global ranks are given by :class:`TransferGroups`).
Each prefill rank runs a :class:`KVSender` over its paged caches, each decode rank a :class:`KVReceiver` over its
``kvops.PagedKVCache``. Both sides compute the same routes (``kvops.transfer.routing``) and first exchange
:class:`~kvops.transfer.routing.KVArgs` with every peer (:meth:`connect`): a layout mismatch raises ``ValueError`` on
both sides before any KV byte moves. The protocol per request (``docs/transfer.md``; wire format:
:mod:`kvops.transfer.wire`):

1. **Metadata.** Each writer sends each of its decode ranks a fixed-size header (request id, token count, layers,
   heads, head_dim, dtype, staging grid, payload bytes, checksum flag); the decode rank, having placed the request
   (allocated its blocks), answers each writer with what it expects and a status. Both compare field by field: a
   difference, a refusal (out of blocks, duplicate request id) or a missing header makes *both* sides raise
   :class:`KVTransferError` before any KV moves; the decode rank releases the blocks. A request of 0 tokens
   completes here (one empty segment: metadata only, as sglang's sender).
2. **KV.** Both sides split ``[0, num_tokens)`` at the staging grid (``staging_grid_tokens(chunked_prefill_size,
   block_size)``); per segment each writer gathers its head slice of all layers into one contiguous staging buffer
   (``kvops.paged_kv_gather``) and sends it with an end marker (and, with ``checksum=True``, a payload checksum);
   the decode rank receives its writers' messages with ``batch_isend_irecv``, checks each marker (a short message or
   one of another request or segment is rejected) and scatters each into its own pages at the writer's
   ``cache_head_start`` (``kvops.paged_kv_scatter``).
3. **Agreement** (with ``decode_group``): one ``all_reduce`` of the decode ranks' outcomes, under the same deadline.

Messages are tagged with the request id, so requests never mix (gloo matches tags; NCCL ignores them and matches in
posting order, so with NCCL both sides must handle requests in the same order, and a pair on which a request failed
should not be reused). Reuse a failed request's id only once its peers are known to be done with it: a receive given
up on stays posted under that tag.

Faults. A writer that dies (peer connection closed) or whose message does not arrive within ``timeout_s`` seconds
(per step: the metadata, each segment, the agreement) fails the request on that decode rank: the receiver still
posts the receives of the request's remaining segments (into discard buffers, so every writer's sends can complete,
a stalled one's once it resumes), frees the request's blocks, never marks it ready and raises
:class:`KVTransferError`; it then serves the next request as before. A request's data only ever lands in its own
blocks, and only after every writer's slice of a segment arrived whole, so other requests' KV is never touched.
With ``decode_group`` given, the decode ranks agree on the outcome (a request is ready only when every decode rank
received its part); a decode rank that stalls or dies there fails the request on the others within ``timeout_s``.
A decode rank that gives up on the agreement cannot retract its vote: a peer that stalled past the deadline and
then completes may still see the request ready (no bounded-time protocol avoids this); the serving layer treats a
request as ready only when no decode rank raised.

Timeouts are enforced by joining a waiter thread against a deadline, never with
``Work.wait(timeout)``: gloo answers a timed-out wait by closing *every* connection of the process ("Application
timeout caused pair closure"), which would turn one stalled peer into a failure of all of them (and gloo's works
report completion only through ``wait``, so ``is_completed`` cannot be polled). A receive (or send) given up on stays
posted; its buffer is kept alive until it completes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..ops.transfer import staging_shape
from . import wire
from .routing import KVArgs, heads_per_rank, rank_head_range, staging_grid_tokens, writer_bytes

_HANDSHAKE_TAG = 2**30
MAX_REQUEST_ID = 2**30 - 1


class KVTransferError(RuntimeError):
    """A request's KV transfer failed (a peer died or stalled past the timeout, the two sides' metadata differ, the
    request could not be placed, or a message arrived short or corrupted). On the decode side the request's blocks
    have been released and it is not ready; both endpoints keep serving later requests."""


@dataclass(frozen=True)
class TransferGroups:
    """Global ranks of the prefill TP group and the decode TP group, each in TP-rank order (disjoint)."""

    prefill_ranks: tuple[int, ...]
    decode_ranks: tuple[int, ...]

    def __post_init__(self):
        if not self.prefill_ranks or not self.decode_ranks or set(self.prefill_ranks) & set(self.decode_ranks):
            raise ValueError(
                f"TransferGroups needs non-empty, disjoint prefill and decode ranks, got {self.prefill_ranks} and "
                f"{self.decode_ranks}."
            )


@dataclass
class TransferStats:
    """What one side moved for one request: ``bytes_per_peer`` maps the peer's TP rank (writer on the decode side,
    decode rank on the prefill side) to bytes; ``seconds`` is wall time of the whole request on this side."""

    request_id: int
    num_tokens: int
    segments: list[tuple[int, int]]
    bytes_per_peer: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(self.bytes_per_peer.values())


def _check_timeout(name: str, timeout_s) -> float:
    """A deadline in seconds: a finite positive number (``-1``, ``0``, ``inf``, ``nan`` or a bool would make every
    wait fail at once or never time out)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise ValueError(
            f"{name} must be a finite number of seconds > 0 (each step's deadline), got {timeout_s!r}. Pass e.g. "
            f"timeout_s=30.0."
        )
    return float(timeout_s)


def _check_request(request_id, num_tokens) -> None:
    if isinstance(request_id, bool) or not isinstance(request_id, int) or not 0 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(
            f"request_id must be an int in [0, {MAX_REQUEST_ID}] (it tags the request's messages), got "
            f"{request_id!r}."
        )
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise ValueError(
            f"num_tokens must be a non-negative int (the request's token count, 0 for a metadata-only request), got "
            f"{num_tokens!r}."
        )


class _Endpoint:
    side = ""

    def __init__(self, groups, tp_rank, k_caches, v_caches, total_kv_heads, chunked_prefill_size, timeout_s,
                 checksum):
        ranks = groups.prefill_ranks if self.side == "prefill" else groups.decode_ranks
        if not 0 <= tp_rank < len(ranks):
            raise ValueError(f"{self.side} tp_rank={tp_rank} is outside [0, {len(ranks)}).")
        if len(k_caches) == 0 or len(k_caches) != len(v_caches):
            raise ValueError(f"k_caches and v_caches must be non-empty and of equal length, got {len(k_caches)} and "
                             f"{len(v_caches)}.")
        self.groups, self.tp_rank = groups, tp_rank
        self.prefill_tp, self.decode_tp = len(groups.prefill_ranks), len(groups.decode_ranks)
        self.k_caches, self.v_caches = list(k_caches), list(v_caches)
        self.total_kv_heads = total_kv_heads
        _, self.block_size, local_heads, self.head_dim = k_caches[0].shape
        expected = heads_per_rank(total_kv_heads, len(ranks))
        if local_heads != expected:
            raise ValueError(
                f"{self.side} rank {tp_rank} caches hold {local_heads} KV heads but total_kv_heads={total_kv_heads} "
                f"over {self.side} tp_size={len(ranks)} gives each rank {expected}; allocate caches with {expected} "
                f"KV heads."
            )
        self.num_layers = len(k_caches)
        self.dtype = k_caches[0].dtype
        self.grid_tokens = staging_grid_tokens(chunked_prefill_size, self.block_size)
        self.timeout_s = _check_timeout("timeout_s", timeout_s)
        self.checksum = bool(checksum)
        self.device = k_caches[0].device
        self.head_offset = rank_head_range(total_kv_heads, len(ranks), tp_rank)[0]  # first global head held here
        self._abandoned: list = []  # (waiter thread, works, buffers) given up on but still posted
        self.kv_args = KVArgs(total_kv_heads, local_heads, self.head_dim, str(self.dtype).removeprefix("torch."),
                              self.block_size, self.num_layers, len(ranks))

    def _handshake(self, peers: list[int], peer_side_ranks, timeout_s) -> list[KVArgs]:
        """Exchange ``KVArgs`` with each peer (TP ranks of the other side); returns theirs."""
        if timeout_s is not None:
            _check_timeout("connect: timeout_s", timeout_s)
        mine = wire.frame(self.kv_args.encode(), self.device)
        theirs = [wire.empty_frame(self.device) for _ in peers]
        ops = []
        for p, buf in zip(peers, theirs):
            ops += [dist.P2POp(dist.isend, mine, peer_side_ranks[p], tag=_HANDSHAKE_TAG),
                    dist.P2POp(dist.irecv, buf, peer_side_ranks[p], tag=_HANDSHAKE_TAG)]
        if ops:
            bufs = [b for t in theirs for b in (mine, t)]
            reasons = self._wait(dist.batch_isend_irecv(ops), bufs, timeout_s)
            for peer, reason in zip([p for p in peers for _ in (0, 1)], reasons):
                if reason is not None:
                    raise KVTransferError(
                        f"KV transfer handshake of {self.side} rank {self.tp_rank} with peer rank {peer} failed: "
                        f"{reason}."
                    )
        out = []
        for peer, t in zip(peers, theirs):
            values, why = wire.unframe(t, len(self.kv_args.encode()))
            if values is None:
                raise KVTransferError(
                    f"KV transfer handshake of {self.side} rank {self.tp_rank} with peer rank {peer} failed: it sent "
                    f"{why}. Run the same kvops version on both sides."
                )
            out.append(KVArgs.decode(values))
        return out

    def _header(self, request_id: int, num_tokens: int, head_start: int, num_heads: int, status: int) -> torch.Tensor:
        return wire.encode(dict(
            request_id=request_id, num_tokens=num_tokens, num_layers=self.num_layers, head_start=head_start,
            num_heads=num_heads, head_dim=self.head_dim, dtype=wire.dtype_code(self.dtype),
            grid_tokens=self.grid_tokens,
            payload_bytes=writer_bytes(num_tokens, num_heads, self.head_dim * self.dtype.itemsize, self.num_layers),
            checksum=int(self.checksum), status=status), self.device)

    def _message(self, num_tokens: int, num_heads: int):
        """A KV message for ``num_tokens`` tokens of ``num_heads`` heads: ``(buffer, payload_bytes, staging view)``."""
        shape = staging_shape(self.num_layers, num_tokens, num_heads, self.head_dim)
        payload = 2 * self.num_layers * num_tokens * num_heads * self.head_dim * self.dtype.itemsize
        buf = torch.empty(wire.message_bytes(payload), dtype=torch.uint8, device=self.device)
        return buf, payload, wire.split(buf, payload, self.dtype, shape)[0]

    def _post(self, ops: list) -> tuple[list, str | None]:
        """``batch_isend_irecv(ops)``: the works, or ``[]`` and why posting failed (e.g. a peer's connection is
        already closed)."""
        if not ops:
            return [], None
        try:
            return dist.batch_isend_irecv(ops), None
        except RuntimeError as err:
            return [], f"connection failed: {err}"

    def _keep(self, works: list, buffers: list) -> None:
        """Keep posted works (and their buffers) alive, never waited on, until they complete."""
        if works:
            thread = threading.Thread(target=_wait_all, args=(works, buffers, [None] * len(works)), daemon=True)
            thread.start()
            self._abandoned.append((thread, works, buffers))

    def _wait(self, works: list, buffers: list, timeout_s: float | None = None) -> list[str | None]:
        """Wait for the works until ``timeout_s`` (default: the endpoint's) after the call; returns per work ``None``
        (done) or why it failed.

        One daemon thread waits on the works in order (``Work.wait()`` without a timeout: gloo's works report
        completion only through ``wait``) while the caller waits for it against the deadline. When the deadline
        passes, the work the thread is stuck on and every later one count as failed ("no message"); they stay
        posted and are kept (with their buffers and the thread) until they complete, so no message ever lands in a
        freed buffer.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self._abandoned = [x for x in self._abandoned if x[0].is_alive()]
        if not works:
            return []
        results: list = [None] * len(works)  # filled by the thread: "" (done) or the error text
        thread = threading.Thread(target=_wait_all, args=(works, buffers, results), daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            self._abandoned.append((thread, works, buffers))
        return [
            f"no message within {timeout_s:g} s" if r is None else (None if r == "" else f"connection failed: {r}")
            for r in results
        ]


def _wait_all(works, buffers, results: list) -> None:
    for i, (work, buf) in enumerate(zip(works, buffers)):
        try:
            work.wait()
            if buf is not None and buf.is_cuda:  # NCCL: wait() orders the current stream; the host needs the data
                torch.cuda.current_stream(buf.device).synchronize()
            results[i] = ""
        except RuntimeError as err:
            results[i] = str(err) or type(err).__name__

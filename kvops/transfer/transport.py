"""Prefill→decode KV transfer over ``torch.distributed`` point-to-point (gloo on CPU, NCCL on GPU).

One world holds a prefill TP group and a decode TP group (their global ranks are given by :class:`TransferGroups`).
Each prefill rank runs a :class:`KVSender` over its paged caches, each decode rank a :class:`KVReceiver` over its
``kvops.PagedKVCache``. Both sides compute the same plan (``kvops.transfer.plan``) and first exchange
:class:`~kvops.transfer.plan.KVArgs` with every peer (:meth:`connect`): a layout mismatch raises ``ValueError`` on
both sides before any KV byte moves. Per request, both sides split ``[0, num_tokens)`` at the staging grid
(``staging_grid_tokens(chunked_prefill_size, block_size)``); per segment each writer gathers its head slice of all
layers into one contiguous staging buffer (``kvops.paged_kv_gather``) and sends it; the decode rank receives its
writers' buffers back to back (writer-major) with ``batch_isend_irecv`` and scatters each into its own pages at the
writer's ``cache_head_start`` (``kvops.paged_kv_scatter``). Messages are tagged with the request id, so requests
never mix (gloo matches tags; NCCL ignores them and matches in posting order, so with NCCL both sides must handle
requests in the same order, and a pair on which a request failed should not be reused).

Faults (decode side): a writer that dies (peer connection closed) or whose message does not arrive within
``timeout_s`` seconds (per segment) fails the request: the receiver still posts the receives of the request's
remaining segments (into discard buffers, so every writer's sends can complete, a stalled one's once it resumes),
frees the request's blocks, never marks it ready and raises :class:`KVTransferError`. A request's data only ever
lands in its own blocks, and only after every writer's slice of a segment arrived, so other requests' KV is never
touched. With ``decode_group`` given, the decode ranks agree on the outcome (a request is ready only when every
decode rank received its part).

Timeouts are enforced by joining a waiter thread against a deadline, never with
``Work.wait(timeout)``: gloo answers a timed-out wait by closing *every* connection of the process ("Application
timeout caused pair closure"), which would turn one stalled peer into a failure of all of them (and gloo's works
report completion only through ``wait``, so ``is_completed`` cannot be polled). A receive (or send) given up on stays
posted; its buffer is kept alive until it completes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..ops.transfer import paged_kv_gather, paged_kv_scatter, staging_shape
from .plan import (
    KVArgs,
    check_transfer_metadata,
    compute_grid_segments,
    compute_head_slice_params,
    heads_per_rank,
    plan_for_writer,
    staging_grid_tokens,
)

_HANDSHAKE_TAG = 2**30
MAX_REQUEST_ID = 2**30 - 1


class KVTransferError(RuntimeError):
    """A request's KV transfer failed (a peer died, stalled past the timeout, or the request could not be placed).
    On the decode side the request's blocks have been released and it is not ready."""


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


def _check_request_id(request_id) -> None:
    if not isinstance(request_id, int) or not 0 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(
            f"request_id must be an int in [0, {MAX_REQUEST_ID}] (it tags the request's messages), got "
            f"{request_id!r}."
        )


class _Endpoint:
    side = ""

    def __init__(self, groups, tp_rank, k_caches, v_caches, total_kv_heads, chunked_prefill_size, timeout_s):
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
        self.timeout_s = float(timeout_s)
        self._abandoned: list = []  # (waiter thread, works, buffers) given up on but still posted
        self.kv_args = KVArgs(total_kv_heads, local_heads, self.head_dim, str(self.dtype).removeprefix("torch."),
                              self.block_size, self.num_layers, len(ranks))

    def _handshake(self, peers: list[int], peer_side_ranks) -> list[KVArgs]:
        """Exchange ``KVArgs`` with each peer (TP ranks of the other side); returns theirs."""
        mine = torch.tensor(self.kv_args.encode(), dtype=torch.int64, device=self.k_caches[0].device)
        theirs = [torch.zeros_like(mine) for _ in peers]
        ops = []
        for p, buf in zip(peers, theirs):
            ops += [dist.P2POp(dist.isend, mine, peer_side_ranks[p], tag=_HANDSHAKE_TAG),
                    dist.P2POp(dist.irecv, buf, peer_side_ranks[p], tag=_HANDSHAKE_TAG)]
        if ops:
            bufs = [b for t in theirs for b in (mine, t)]
            for peer, reason in zip([p for p in peers for _ in (0, 1)], self._wait(dist.batch_isend_irecv(ops), bufs)):
                if reason is not None:
                    raise KVTransferError(
                        f"KV transfer handshake of {self.side} rank {self.tp_rank} with peer rank {peer} failed: "
                        f"{reason}."
                    )
        return [KVArgs.decode(t.tolist()) for t in theirs]

    def _alloc(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.dtype, device=self.k_caches[0].device)

    def _wait(self, works: list, buffers: list) -> list[str | None]:
        """Wait for the works until ``timeout_s`` after the call; returns per work ``None`` (done) or why it failed.

        One daemon thread waits on the works in order (``Work.wait()`` without a timeout: gloo's works report
        completion only through ``wait``) while the caller waits for it against the deadline. When the deadline
        passes, the work the thread is stuck on and every later one count as failed ("no message"); they stay
        posted and are kept (with their buffers and the thread) until they complete, so no message ever lands in a
        freed buffer.
        """
        self._abandoned = [x for x in self._abandoned if x[0].is_alive()]
        results: list = [None] * len(works)  # filled by the thread: "" (done) or the error text
        thread = threading.Thread(target=_wait_all, args=(works, buffers, results), daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            self._abandoned.append((thread, works, buffers))
        return [
            f"no message within {self.timeout_s:g} s" if r is None else (None if r == "" else f"connection failed: {r}")
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


class KVSender(_Endpoint):
    """Prefill side: sends one request's KV (its head slices, all layers) to the decode ranks the plan assigns.

    Args:
        groups: the world's prefill and decode ranks. tp_rank: this rank's index in ``groups.prefill_ranks``.
        k_caches, v_caches: this rank's ``L`` paged caches ``[P, block_size, H // P_tp (or 1), D]`` each.
        total_kv_heads: ``H`` (see ``resolve_total_kv_heads``). chunked_prefill_size: staging grid size in tokens
            (rounded to whole pages). timeout_s: seconds each segment's messages (and the handshake) may take.
    """

    side = "prefill"

    def __init__(self, groups: TransferGroups, tp_rank: int, k_caches, v_caches, total_kv_heads: int, *,
                 chunked_prefill_size: int = 8192, timeout_s: float = 30.0) -> None:
        super().__init__(groups, tp_rank, k_caches, v_caches, total_kv_heads, chunked_prefill_size, timeout_s)
        self.targets = plan_for_writer(self.prefill_tp, self.decode_tp, tp_rank, total_kv_heads)
        self._slices = sorted({(s.src_head_start, s.num_heads) for _, s in self.targets})

    def connect(self) -> None:
        """Exchange layouts with every decode rank this rank writes to; ``ValueError`` on any mismatch."""
        peers = sorted({d for d, _ in self.targets})
        for theirs in self._handshake(peers, self.groups.decode_ranks):
            check_transfer_metadata(self.kv_args, theirs)

    def send(self, request_id: int, num_tokens: int, block_table: torch.Tensor) -> TransferStats:
        """Send tokens ``[0, num_tokens)`` of the request whose pages are ``block_table`` (1-D int32/int64).

        Raises ``KVTransferError`` when a decode rank is gone or does not receive within ``timeout_s``.
        """
        _check_request_id(request_id)
        t0 = time.perf_counter()
        segments = compute_grid_segments(0, num_tokens, 0, self.grid_tokens)
        stats = TransferStats(request_id, num_tokens, segments, {d: 0 for d, _ in self.targets})
        for s, e in segments:
            bufs = {}
            for h0, nh in self._slices:  # one gather per distinct slice, sent to every decode rank needing it
                buf = self._alloc(2 * self.num_layers * (e - s) * nh * self.head_dim)
                bufs[h0, nh] = buf.view(staging_shape(self.num_layers, e - s, nh, self.head_dim))
                paged_kv_gather(self.k_caches, self.v_caches, block_table, bufs[h0, nh], s, h0)
            sends = [bufs[sl.src_head_start, sl.num_heads] for _, sl in self.targets]
            ops = [dist.P2POp(dist.isend, buf, self.groups.decode_ranks[d], tag=request_id)
                   for (d, _), buf in zip(self.targets, sends)]
            try:
                reasons = self._wait(dist.batch_isend_irecv(ops), sends) if ops else []
            except RuntimeError as err:  # posting failed (e.g. the peer's connection is already closed)
                reasons = [f"connection failed: {err}"] * len(ops)
            failed = [(d, r) for (d, _), r in zip(self.targets, reasons) if r is not None]
            if failed:
                raise KVTransferError(
                    f"KV transfer of request {request_id} failed on prefill rank {self.tp_rank}: sending tokens "
                    f"[{s}, {e}) to decode rank {failed[0][0]} did not complete ({failed[0][1]})."
                )
            for d, sl in self.targets:
                stats.bytes_per_peer[d] += bufs[sl.src_head_start, sl.num_heads].numel() * self.dtype.itemsize
        stats.seconds = time.perf_counter() - t0
        return stats


class KVReceiver(_Endpoint):
    """Decode side: receives requests' KV into a ``kvops.PagedKVCache`` (its layers' caches, this rank's heads).

    Args:
        groups, tp_rank: as :class:`KVSender` (``tp_rank`` indexes ``groups.decode_ranks``).
        cache: the decode rank's ``PagedKVCache`` (``num_kv_heads = max(1, H // D_tp)``); blocks are allocated per
            request in :meth:`receive`.
        total_kv_heads, chunked_prefill_size, timeout_s: as :class:`KVSender` (must match the senders).
        decode_group: optional process group of the decode ranks; then a request is ready only if every decode rank
            received its part (one ``all_reduce`` per request).

    Attributes:
        ready: ids of the requests whose KV is complete on this rank (and, with ``decode_group``, on all).
        writers: ``compute_head_slice_params(P_tp, D_tp, tp_rank, H)``, the staging buffer's writer order.
    """

    side = "decode"

    def __init__(self, groups: TransferGroups, tp_rank: int, cache, total_kv_heads: int, *,
                 chunked_prefill_size: int = 8192, timeout_s: float = 30.0, decode_group=None) -> None:
        super().__init__(groups, tp_rank, cache.k_caches, cache.v_caches, total_kv_heads, chunked_prefill_size,
                         timeout_s)
        self.cache = cache
        self.decode_group = decode_group
        self.writers = compute_head_slice_params(self.prefill_tp, self.decode_tp, tp_rank, total_kv_heads)
        self.ready: set[int] = set()
        self._dead: set[int] = set()  # writers whose connection failed (closed or timed out): never waited on again

    def connect(self) -> None:
        """Exchange layouts with every writer; ``ValueError`` on any mismatch (no KV moves)."""
        for theirs in self._handshake([s.writer for s in self.writers], self.groups.prefill_ranks):
            check_transfer_metadata(theirs, self.kv_args)

    def receive(self, request_id: int, num_tokens: int) -> TransferStats:
        """Allocate the request's blocks (sequence id ``request_id``), receive and scatter its KV, mark it ready.

        Raises ``KVTransferError`` (after draining healthy writers and freeing the request's blocks; the request is
        not ready) when a writer is dead, stalls past ``timeout_s``, the cache is out of blocks, or (with
        ``decode_group``) another decode rank failed.
        """
        _check_request_id(request_id)
        t0 = time.perf_counter()
        segments = compute_grid_segments(0, num_tokens, 0, self.grid_tokens)
        stats = TransferStats(request_id, num_tokens, segments, {s.writer: 0 for s in self.writers})
        failure = None
        block_table = None
        added = False
        try:
            self.cache.add_sequence(request_id)
            added = True
            self.cache.extend(request_id, num_tokens)
            block_table = torch.tensor(self.cache.block_ids(request_id), dtype=torch.int32,
                                       device=self.cache.device)
        except (RuntimeError, ValueError) as err:  # OutOfBlocksError, duplicate id: drain, then fail
            failure = f"its {num_tokens} tokens could not be placed ({err})"
        for s, e in segments:
            views, ops = [], []
            flat = self._alloc(sum(2 * self.num_layers * (e - s) * w.num_heads * self.head_dim for w in self.writers))
            offset = 0
            for w in self.writers:
                view = flat[offset : offset + 2 * self.num_layers * (e - s) * w.num_heads * self.head_dim]
                views.append(view.view(staging_shape(self.num_layers, e - s, w.num_heads, self.head_dim)))
                offset += view.numel()
            live = [i for i, w in enumerate(self.writers) if w.writer not in self._dead]
            ops = [dist.P2POp(dist.irecv, views[i], self.groups.prefill_ranks[self.writers[i].writer], tag=request_id)
                   for i in live]
            try:
                works = dist.batch_isend_irecv(ops) if ops else []
            except RuntimeError as err:  # posting failed: treat every writer of the segment as gone
                self._dead.update(self.writers[i].writer for i in live)
                failure = failure or f"posting receives for tokens [{s}, {e}) failed ({err})"
                break
            if failure is not None:  # draining: writers' messages are received into discard buffers, never waited
                self._abandoned += [(work, views[i]) for i, work in zip(live, works)]
                continue
            for i, reason in zip(live, self._wait(works, [views[i] for i in live])):
                w = self.writers[i]
                if reason is None:
                    stats.bytes_per_peer[w.writer] += views[i].numel() * self.dtype.itemsize
                    continue
                if reason.startswith("connection failed"):
                    self._dead.add(w.writer)
                failure = failure or (
                    f"prefill rank {w.writer} (global rank {self.groups.prefill_ranks[w.writer]}) sent no data for "
                    f"tokens [{s}, {e}): {reason}"
                )
            if failure is None and len(live) == len(self.writers):
                # every writer's slice of this segment arrived: write them into the request's pages
                for w, view in zip(self.writers, views):
                    paged_kv_scatter(view, self.k_caches, self.v_caches, block_table, s, w.cache_head_start)
        if failure is None and any(w.writer in self._dead for w in self.writers):
            failure = f"prefill ranks {sorted(self._dead)} are gone (their connections failed earlier)"
        if self.decode_group is not None:
            ok = torch.tensor([0 if failure else 1], dtype=torch.int32, device=self.k_caches[0].device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.decode_group)
            if failure is None and int(ok) == 0:
                failure = "another decode rank of the group failed to receive its part"
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

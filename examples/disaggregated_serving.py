"""Prefill/decode disaggregation with different TP sizes: prefill on TP 4, KV transfer, greedy decode on TP 2.

A tensor-parallel decoder with the attention geometry of Llama-3.2-1B (docs/models.md: 32 query heads / 8 KV heads x
head_dim 64, GQA 4:1, hidden 2048, RoPE theta 500000, RMSNorm, SwiGLU) and **random weights** (seeded; no download)
prefills several requests of different lengths on the prefill ranks (each holding 8 query / 2 KV heads, its own
``kvops.PagedKVCache``, writes via ``kvops.paged_cache_write``, attention via ``kvops.paged_attention``, an
``all_reduce`` after the attention output and the MLP down projections). The prompts' KV then moves to the decode
ranks (16 query / 4 KV heads each) with ``kvops.transfer`` (each decode rank receives from 2 prefill writers; requests
split at the staging grid), and the decode ranks generate greedily. The same model run in one process (all heads, no
TP) must produce the same tokens.

Scaled to a 2-core CPU (printed as such): layers 16 -> --layers, FFN 8192 -> --ffn, vocabulary 128256 -> --vocab; the
head geometry and hidden size are the model's.

Printed: tokens identical to a single-process run (True/False), bytes moved per writer vs the plan, transfer GB/s
(all decode ranks, from the first gather to the last scatter; median and spread over --rounds transfers of the same
KV, each followed by a baseline: the same bytes as one plain send per writer), and timings.

    python examples/disaggregated_serving.py                         # spawns 4 + 2 processes (gloo, CPU)
    torchrun --nproc-per-node 6 examples/disaggregated_serving.py    # the same under torchrun
    torchrun --nproc-per-node 6 examples/disaggregated_serving.py --device cuda   # NCCL, one GPU per rank
"""

from __future__ import annotations

import datetime
import os
import pathlib
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvops.cache import PagedKVCache
from kvops.transfer import (KVReceiver, KVSender, TransferGroups, compute_head_slice_params, rank_head_range,
                            staging_grid_tokens, writer_bytes)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # examples/_common.py, from any working directory
from _common import parser, rope  # noqa: E402

# Llama-3.2-1B (docs/models.md / its config.json)
HIDDEN, H_Q, H_KV, HEAD_DIM, ROPE_THETA = 2048, 32, 8, 64, 500_000.0
FULL = {"layers": 16, "ffn": 8192, "vocab": 128256}


def full_weights(args, dtype, device):
    """The whole model's weights, N(0, 1/fan_in) from a fixed seed (every rank builds the same, then shards)."""
    g = torch.Generator().manual_seed(0)
    w = lambda rows, cols: (torch.randn(rows, cols, generator=g) / cols**0.5).to(dtype).to(device)  # noqa: E731
    layers = [{"q": w(H_Q * HEAD_DIM, HIDDEN), "k": w(H_KV * HEAD_DIM, HIDDEN), "v": w(H_KV * HEAD_DIM, HIDDEN),
               "o": w(HIDDEN, H_Q * HEAD_DIM), "gate": w(args.ffn, HIDDEN), "up": w(args.ffn, HIDDEN),
               "down": w(HIDDEN, args.ffn)} for _ in range(args.layers)]
    return {"embed": w(args.vocab, HIDDEN) * HIDDEN**0.5, "lm_head": w(args.vocab, HIDDEN), "layers": layers}


class TPModel:
    """Rank ``rank`` of a ``tp``-way tensor-parallel Llama: query heads, KV heads (replicated when ``tp > H_KV``)
    and FFN columns are sharded; ``all_reduce`` over ``group`` after ``o`` and ``down``. ``tp=1``: the whole model."""

    def __init__(self, weights, tp, rank, group):
        self.tp, self.group = tp, group
        self.hq = H_Q // tp
        k0, k1 = rank_head_range(H_KV, tp, rank)
        self.hkv = k1 - k0
        q_rows = slice(rank * self.hq * HEAD_DIM, (rank + 1) * self.hq * HEAD_DIM)
        kv_rows = slice(k0 * HEAD_DIM, k1 * HEAD_DIM)
        ffn = weights["layers"][0]["gate"].shape[0] // tp
        f_rows = slice(rank * ffn, (rank + 1) * ffn)
        self.embed, self.lm_head = weights["embed"], weights["lm_head"]
        self.layers = [{"qkv": torch.cat([lw["q"][q_rows], lw["k"][kv_rows], lw["v"][kv_rows]]),
                        "o": lw["o"][:, q_rows].contiguous(), "gate_up": torch.cat([lw["gate"][f_rows],
                                                                                   lw["up"][f_rows]]),
                        "down": lw["down"][:, f_rows].contiguous()} for lw in weights["layers"]]

    def _reduce(self, x):
        if self.tp > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def forward(self, ids, positions, cache: PagedKVCache, step):
        """Greedy next token of each sequence of ``step`` (its last row); writes K/V into ``cache``."""
        n = ids.shape[0]
        x = F.embedding(ids, self.embed)
        for layer, w in enumerate(self.layers):
            h = F.rms_norm(x, (HIDDEN,), eps=1e-5)
            q, k, v = F.linear(h, w["qkv"]).split([self.hq * HEAD_DIM, self.hkv * HEAD_DIM, self.hkv * HEAD_DIM], -1)
            q = rope(q.view(n, self.hq, HEAD_DIM), positions, ROPE_THETA)
            k = rope(k.view(n, self.hkv, HEAD_DIM), positions, ROPE_THETA)
            cache.write(layer, k, v.reshape(n, self.hkv, HEAD_DIM), step)
            attn = cache.attention(layer, q, step)
            x = x + self._reduce(F.linear(attn.reshape(n, -1), w["o"]))
            gate, up = F.linear(F.rms_norm(x, (HIDDEN,), eps=1e-5), w["gate_up"]).chunk(2, dim=-1)
            x = x + self._reduce(F.linear(F.silu(gate) * up, w["down"]))
        last = (step.cu_seqlens_q[1 : len(step.seq_ids) + 1] - 1).long()
        return F.linear(F.rms_norm(x[last], (HIDDEN,), eps=1e-5), self.lm_head).argmax(-1)


def prefill(model, cache, prompts, device):
    """One varlen step over all prompts; returns each request's first generated token."""
    for rid in prompts:
        cache.add_sequence(rid)
    step = cache.prepare({rid: len(p) for rid, p in prompts.items()})
    ids = torch.tensor([t for p in prompts.values() for t in p], device=device)
    pos = torch.tensor([i for p in prompts.values() for i in range(len(p))], device=device)
    return dict(zip(step.seq_ids, model.forward(ids, pos, cache, step).tolist()))


def decode(model, cache, first, lengths, steps, device):
    """Greedy decode of every request from its first token; returns ``{rid: tokens}`` (first included)."""
    out = {rid: [t] for rid, t in first.items()}
    for _ in range(steps - 1):
        step = cache.prepare({rid: 1 for rid in out})
        ids = torch.tensor([out[rid][-1] for rid in step.seq_ids], device=device)
        pos = torch.tensor([lengths[rid] + len(out[rid]) - 1 for rid in step.seq_ids], device=device)
        for rid, t in zip(step.seq_ids, model.forward(ids, pos, cache, step).tolist()):
            out[rid].append(t)
    return out


def new_cache(args, heads, dtype, device):
    return PagedKVCache(args.num_blocks, args.block_size, heads, HEAD_DIM, num_layers=args.layers, dtype=dtype,
                        device=device)


def worker(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    p_tp, d_tp = args.prefill_tp, args.decode_tp
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if args.device == "cuda" else "cpu")
    dtype = getattr(torch, args.dtype)
    groups = TransferGroups(tuple(range(p_tp)), tuple(range(p_tp, p_tp + d_tp)))
    prefill_group = dist.new_group(list(groups.prefill_ranks))
    decode_group = dist.new_group(list(groups.decode_ranks))
    weights = full_weights(args, dtype, device)
    g = torch.Generator().manual_seed(1)
    prompts = {rid: torch.randint(0, args.vocab, (n,), generator=g).tolist() for rid, n in enumerate(args.lengths)}
    lengths = {rid: len(p) for rid, p in prompts.items()}
    report = {"rank": rank}
    if rank < p_tp:
        model = TPModel(weights, p_tp, rank, prefill_group)
        cache = new_cache(args, model.hkv, dtype, device)
        t0 = time.perf_counter()
        first = prefill(model, cache, prompts, device)
        report["prefill_s"] = time.perf_counter() - t0
        sender = KVSender(groups, rank, cache.k_caches, cache.v_caches, H_KV, chunked_prefill_size=args.chunk)
        sender.connect()
        tables = {rid: torch.tensor(cache.block_ids(rid), dtype=torch.int32, device=device) for rid in prompts}
        for r in range(args.rounds):  # the same KV, `rounds` times (request ids r * 1000 + rid), each then raw
            dist.barrier()  # timed from here on the decode side: prefill done, receivers connected
            sent: dict[int, int] = {}
            for rid in prompts:
                for d, b in sender.send(1000 * r + rid, lengths[rid], tables[rid]).bytes_per_peer.items():
                    sent[d] = sent.get(d, 0) + b
            dist.barrier()  # baseline: the same bytes to the same decode ranks as one plain message each
            raw = [dist.P2POp(dist.isend, torch.empty(b // dtype.itemsize, dtype=dtype, device=device),
                              groups.decode_ranks[d]) for d, b in sent.items()]
            for work in dist.batch_isend_irecv(raw):
                work.wait()
        if rank == 0:  # the first sampled tokens travel with the KV (every prefill rank computed the same ones)
            first_t = torch.tensor([first[rid] for rid in prompts], dtype=torch.int64, device=device)
            for d in groups.decode_ranks:
                dist.send(first_t, d)
    else:
        d = rank - p_tp
        model = TPModel(weights, d_tp, d, decode_group)
        cache = new_cache(args, model.hkv, dtype, device)
        recv = KVReceiver(groups, d, cache, H_KV, chunked_prefill_size=args.chunk, decode_group=decode_group)
        recv.connect()
        report["transfer_s"], report["raw_s"] = [], []
        for r in range(args.rounds):
            dist.barrier()
            t0 = time.perf_counter()
            stats = [recv.receive(1000 * r + rid, lengths[rid]) for rid in prompts]
            report["transfer_s"].append(time.perf_counter() - t0)
            if r < args.rounds - 1:
                for rid in prompts:
                    cache.free(1000 * r + rid)
            report["bytes"] = {w.writer: sum(s.bytes_per_peer[w.writer] for s in stats) for w in recv.writers}
            raw = [dist.P2POp(dist.irecv, torch.empty(b // dtype.itemsize, dtype=dtype, device=device),
                              groups.prefill_ranks[w]) for w, b in report["bytes"].items()]
            dist.barrier()
            t0 = time.perf_counter()
            for work in dist.batch_isend_irecv(raw):
                work.wait()
            report["raw_s"].append(time.perf_counter() - t0)
        report["plan"] = {w.writer: sum(writer_bytes(n, w.num_heads, HEAD_DIM * dtype.itemsize, args.layers)
                                        for n in lengths.values())
                          for w in compute_head_slice_params(p_tp, d_tp, d, H_KV)}
        report["segments"] = {rid: s.segments for rid, s in zip(prompts, stats)}
        first_t = torch.empty(len(prompts), dtype=torch.int64, device=device)
        dist.recv(first_t, 0)
        t0 = time.perf_counter()
        last = {1000 * (args.rounds - 1) + rid: rid for rid in prompts}  # the last round's requests stay
        tokens = decode(model, cache, dict(zip(last, first_t.tolist())), {k: lengths[r] for k, r in last.items()},
                        args.new_tokens, device)
        tokens = {last[k]: t for k, t in tokens.items()}
        report["decode_s"] = time.perf_counter() - t0
        if d == 0:  # the single-process reference: the whole model, all heads, one cache
            t0 = time.perf_counter()
            ref_model = TPModel(weights, 1, 0, None)
            ref_cache = new_cache(args, H_KV, dtype, device)
            ref = decode(ref_model, ref_cache, prefill(ref_model, ref_cache, prompts, device), lengths,
                         args.new_tokens, device)
            report["reference_s"] = time.perf_counter() - t0
            report["identical"] = ref == tokens
            report["tokens"] = tokens
    reports = [None] * world if rank == 0 else None
    dist.gather_object(report, reports, dst=0)
    if rank == 0:
        print_report(args, reports, dtype)


def print_report(args, reports, dtype) -> None:
    p_tp, d_tp = args.prefill_tp, args.decode_tp
    pre, dec = reports[:p_tp], reports[p_tp:]
    print(f"model: Llama-3.2-1B attention geometry ({H_Q} query / {H_KV} KV heads x {HEAD_DIM}, hidden {HIDDEN}), "
          f"random weights, {args.dtype}; scaled for CPU: layers {FULL['layers']} -> {args.layers}, FFN "
          f"{FULL['ffn']} -> {args.ffn}, vocab {FULL['vocab']} -> {args.vocab}")
    print(f"prefill TP {p_tp} (ranks 0-{p_tp - 1}, {max(1, H_KV // p_tp)} KV heads each) -> decode TP {d_tp} (ranks "
          f"{p_tp}-{p_tp + d_tp - 1}, {max(1, H_KV // d_tp)} KV heads each), {args.backend}; staging grid "
          f"{staging_grid_tokens(args.chunk, args.block_size)} tokens, block_size {args.block_size}")
    print(f"requests: {len(args.lengths)}, prompt lengths {args.lengths}, {args.new_tokens} generated tokens each; "
          f"segments of the longest: {dec[0]['segments'][max(range(len(args.lengths)), key=args.lengths.__getitem__)]}")
    print(f"prefill: {max(r['prefill_s'] for r in pre):.3f} s (slowest prefill rank)")
    total = 0
    for d, r in enumerate(dec):
        parts = ", ".join(f"prefill {w}: {b} B (plan {r['plan'][w]}{'' if b == r['plan'][w] else ' MISMATCH'})"
                          for w, b in r["bytes"].items())
        print(f"  decode rank {d} <- {parts}")
        total += sum(r["bytes"].values())
    kv = [total / max(r["transfer_s"][i] for r in dec) / 1e9 for i in range(args.rounds)]
    raw = [total / max(r["raw_s"][i] for r in dec) / 1e9 for i in range(args.rounds)]
    ratio = [a / b for a, b in zip(kv, raw)]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"transfer of {total / 1e6:.2f} MB (all decode ranks; gather + send + receive + scatter), {args.rounds} "
          f"rounds: median {med(kv):.3f} GB/s (min {min(kv):.3f}, max {max(kv):.3f}); the same bytes as one plain "
          f"{args.backend} message per writer: median {med(raw):.3f} GB/s (min {min(raw):.3f}, max {max(raw):.3f}); "
          f"ratio median {med(ratio):.2f} (min {min(ratio):.2f}, max {max(ratio):.2f})")
    n_tok = len(args.lengths) * args.new_tokens
    print(f"decode: {args.new_tokens} tokens x {len(args.lengths)} requests in {max(r['decode_s'] for r in dec):.3f} "
          f"s ({n_tok / max(r['decode_s'] for r in dec):.1f} tokens/s); single-process reference (prefill + decode) "
          f"{dec[0]['reference_s']:.3f} s")
    print(f"tokens identical to a single-process run: {dec[0]['identical']}")
    print(f"tokens of request 0: {dec[0]['tokens'][0]}")


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: gloo, one process per rank; cuda: NCCL, one GPU per rank")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights, activations and KV caches")
    p.add_argument("--prefill-tp", type=int, default=4, help="tensor-parallel ranks of the prefill side")
    p.add_argument("--decode-tp", type=int, default=2, help="tensor-parallel ranks of the decode side")
    p.add_argument("--layers", type=int, default=2, help=f"decoder layers ({FULL['layers']} in Llama-3.2-1B)")
    p.add_argument("--ffn", type=int, default=2048, help=f"MLP width ({FULL['ffn']} in Llama-3.2-1B)")
    p.add_argument("--vocab", type=int, default=1024, help=f"vocabulary size ({FULL['vocab']} in Llama-3.2-1B)")
    p.add_argument("--lengths", type=int, nargs="+", default=[37, 64, 100, 19],
                   help="prompt lengths in tokens, one request each")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens each request generates on the decode side")
    p.add_argument("--block-size", type=int, default=16, help="tokens per paged-cache block")
    p.add_argument("--num-blocks", type=int, default=64, help="blocks per layer of each rank's paged cache")
    p.add_argument("--chunk", type=int, default=64, help="chunked_prefill_size: the staging grid in tokens")
    p.add_argument("--rounds", type=int, default=5, help="transfers of the same KV (timed; the last one decodes)")
    args = p.parse_args(argv)
    args.backend = "nccl" if args.device == "cuda" else "gloo"
    return args


def run(rank: int, world: int, argv) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group(args.backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        worker(args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    import sys

    args = parse_args()
    world = args.prefill_tp + args.decode_tp
    if "RANK" in os.environ:  # torchrun
        if int(os.environ["WORLD_SIZE"]) != world:
            raise SystemExit(f"--nproc-per-node must be prefill_tp + decode_tp = {world}, got "
                             f"{os.environ['WORLD_SIZE']}")
        run(int(os.environ["RANK"]), world, sys.argv[1:])
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = mp.get_context("forkserver")  # one server imports torch and kvops once, then forks every rank
    ctx.set_forkserver_preload(["kvops"])
    procs = [ctx.Process(target=run, args=(r, world, sys.argv[1:])) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    main()

"""Serving a batch of requests on a paged KV cache: chunked prefill + decode, eager vs torch.compile(fullgraph=True).

A decoder-only transformer with the attention geometry of Qwen2.5-0.5B (docs/models.md: 14 query heads / 2 KV heads x
head_dim 64, GQA 7:1, hidden 896, QKV bias, RoPE theta 1e6, RMSNorm, SwiGLU 4864) and random weights serves requests with
ragged prompt lengths through kvops' PagedKVCache: each step packs the decode tokens of running requests with one
chunk of a waiting request's prompt (chunked prefill) into one varlen batch; K/V go into the paged cache through
``kvops.paged_cache_write`` (slot mapping) and attention reads it through ``kvops.paged_attention`` (block table).
Requests finish at their own lengths, their blocks are freed and new requests join, reusing them.

Scaled to a 2-core CPU (and printed as such): layers (24 -> --layers), vocabulary (151936 -> --vocab); the head
geometry, hidden and FFN sizes are the model's. Every step is padded to fixed shapes (a token budget and a batch
width), so the compiled step does not recompile as the batch changes.

Printed: each phase as it starts; whether the greedy tokens of eager and compiled runs are identical, compilations,
time to the first compiled step, tokens/s eager vs compiled (median and spread of interleaved runs, `--repeats`),
and the blocks in use.

    python examples/llm_serving.py                   # CPU
    python examples/llm_serving.py --package pkgs    # compiled = an AOTInductor package, built once, then loaded
    python examples/llm_serving.py --device cuda --dtype bfloat16 --layers 24 --vocab 151936
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from collections import deque

import torch
import torch._dynamo
import torch._inductor.config
import torch.nn.functional as F
from torch import nn

import kvops
from kvops.cache import PagedKVCache

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # examples/_common.py, from any working directory
from _common import (AOTPackage, add_device_options, add_run_options, check_package,  # noqa: E402,F401
                     configure_cpu_inference_compile, cpu_seconds, digest_path, file_digest, input_signature,
                     package_path, parse_run_args, parser, rope, spread)

# Qwen2.5-0.5B (docs/models.md / its config.json)
HIDDEN, H_Q, H_KV, HEAD_DIM, FFN, ROPE_THETA = 896, 14, 2, 64, 4864, 1_000_000.0


def aten_cache_write(k, v, k_cache, v_cache, slot_mapping):
    """The ``--impl aten`` baseline of ``kvops.paged_cache_write``: ``index_put_`` into the flattened caches. Padding
    tokens (slot -1) go to slot 0, which ``--impl aten`` reserves as scratch (block 0 is held by no request)."""
    slots = slot_mapping.clamp(min=0)
    k_cache.view(-1, *k_cache.shape[2:]).index_put_((slots,), k)
    v_cache.view(-1, *v_cache.shape[2:]).index_put_((slots,), v)


def sdpa_paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table):
    """The ``--impl aten`` baseline of ``kvops.paged_attention`` (causal, GQA): gather every row's blocks into one
    key set ``[B * W * block_size]`` and run ``F.scaled_dot_product_attention`` with a boolean mask (token ``i`` of
    row ``b`` sees keys of row ``b`` at positions ``<= seq_lens[b] - q_len_b + local_i``). Rows with no key give 0."""
    n, width, bs = q.shape[0], block_table.shape[1], k_cache.shape[1]
    keys_per_row = width * bs
    k = k_cache[block_table].reshape(1, -1, H_KV, HEAD_DIM).transpose(1, 2)  # [1, H_kv, B * W * bs, D]
    v = v_cache[block_table].reshape(1, -1, H_KV, HEAD_DIM).transpose(1, 2)
    tok = torch.arange(n, device=q.device, dtype=cu_seqlens_q.dtype)
    row = torch.searchsorted(cu_seqlens_q[1:], tok, right=True).clamp(max=seq_lens.shape[0] - 1)
    q_len = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    q_pos = seq_lens[row] - q_len[row] + (tok - cu_seqlens_q[row])  # the query's position in its sequence
    key = torch.arange(k.shape[2], device=q.device)
    key_row, key_pos = key // keys_per_row, key % keys_per_row
    mask = (key_row[None, :] == row[:, None]) & (key_pos[None, :] <= q_pos[:, None])
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, enable_gqa=True)
    return torch.nan_to_num(out[0].transpose(0, 1), nan=0.0)  # [N, H_q, D]; fully masked rows: 0 as kvops


class Layer(nn.Module):
    def __init__(self, impl: str = "kvops"):
        super().__init__()
        self.impl = impl  # "kvops" (the ops) or "aten" (index_put_ writes + SDPA over gathered blocks: baseline)
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN, eps=1e-6), nn.RMSNorm(HIDDEN, eps=1e-6)
        self.qkv = nn.Linear(HIDDEN, (H_Q + 2 * H_KV) * HEAD_DIM, bias=True)
        self.o = nn.Linear(H_Q * HEAD_DIM, HIDDEN, bias=False)
        self.gate_up = nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x, positions, k_cache, v_cache, meta):
        n = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).split([H_Q * HEAD_DIM, H_KV * HEAD_DIM, H_KV * HEAD_DIM], dim=-1)
        q = rope(q.view(n, H_Q, HEAD_DIM), positions, ROPE_THETA)
        k = rope(k.view(n, H_KV, HEAD_DIM), positions, ROPE_THETA)
        if self.impl == "aten":
            aten_cache_write(k, v.view(n, H_KV, HEAD_DIM), k_cache, v_cache, meta["slot_mapping"])
            attn = sdpa_paged_attention(q, k_cache, v_cache, meta["cu_seqlens_q"], meta["seq_lens"],
                                        meta["block_table"])
        else:
            kvops.paged_cache_write(k, v.view(n, H_KV, HEAD_DIM), k_cache, v_cache, meta["slot_mapping"])
            attn = kvops.paged_attention(
                q, k_cache, v_cache, meta["cu_seqlens_q"], meta["seq_lens"], meta["block_table"], meta["max_seqlen_q"]
            )
        x = x + self.o(attn.reshape(n, H_Q * HEAD_DIM))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Model(nn.Module):
    """Weights only; the caches and the step's metadata are arguments (tensors, plus the int ``max_seqlen_q``)."""

    def __init__(self, layers: int, vocab: int, impl: str = "kvops"):
        super().__init__()
        self.embed = nn.Embedding(vocab, HIDDEN)
        self.layers = nn.ModuleList(Layer(impl) for _ in range(layers))
        self.norm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.lm_head = nn.Linear(HIDDEN, vocab, bias=False)

    def forward(self, input_ids, positions, k_caches, v_caches, meta):
        x = self.embed(input_ids)
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            x = layer(x, positions, k_cache, v_cache, meta)
        last = (meta["cu_seqlens_q"][1:] - 1).clamp(min=0).long()  # each batch row's last token
        return self.lm_head(self.norm(x[last])).argmax(-1)  # greedy next token per batch row


class Request:
    def __init__(self, rid: int, prompt: list[int], max_new: int):
        self.rid, self.prompt, self.max_new = rid, prompt, max_new
        self.prefilled, self.generated = 0, []

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


def serve(model, cache: PagedKVCache, requests: list[Request], args, device, sync):
    """Continuous batching: returns ({rid: generated tokens}, generated token count, seconds, block stats)."""
    waiting, running = deque(requests), []
    budget, width = args.token_budget, args.max_batch + 1  # padded step shape: tokens, batch rows
    max_blocks = -(-(args.max_prompt + args.max_new) // args.block_size)
    out, generated, peak, allocated = {}, 0, 0, 0
    t0 = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < args.max_batch:  # admit new requests
            req = waiting.popleft()
            cache.add_sequence(req.rid)
            running.append(req)
        # decode tokens of prefilled requests first, then one prompt chunk of the first request still in prefill
        items, ids = [], []
        left = budget - sum(1 for r in running if r.prefilled == len(r.prompt))
        for r in running:
            if r.prefilled == len(r.prompt):
                items.append((r.rid, 1))
                ids.append(r.tokens[-1])
        for r in running:
            if r.prefilled < len(r.prompt) and left > 0:
                n = min(left, len(r.prompt) - r.prefilled)
                items.append((r.rid, n))
                ids += r.prompt[r.prefilled : r.prefilled + n]
                left -= n
        free_before = cache.num_free_blocks
        step = cache.prepare(items, pad_tokens=budget, pad_batch=width, max_blocks=max_blocks)
        allocated += free_before - cache.num_free_blocks
        peak = max(peak, cache.num_blocks - cache.num_free_blocks)
        pad = budget - len(ids)
        meta = {
            "slot_mapping": step.slot_mapping, "cu_seqlens_q": step.cu_seqlens_q, "seq_lens": step.seq_lens,
            "block_table": step.block_table, "max_seqlen_q": step.max_seqlen_q,
        }
        input_ids = torch.tensor(ids + [0] * pad, device=device)
        # step.positions: each new token's position in its sequence (RoPE), 0 for the padding tokens
        next_tokens = model(input_ids, step.positions, cache.k_caches, cache.v_caches, meta).tolist()
        by_rid = dict(zip(step.seq_ids, next_tokens))
        for rid, n in items:
            r = next(r for r in running if r.rid == rid)
            if r.prefilled < len(r.prompt):
                r.prefilled += n
                if r.prefilled < len(r.prompt):
                    continue  # prompt not finished: this chunk's logits are not a sample
            r.generated.append(by_rid[rid])
            generated += 1
        for r in [r for r in running if len(r.generated) >= r.max_new]:
            running.remove(r)
            cache.free(r.rid)  # blocks go back to the pool and are reused by the next request
            out[r.rid] = r.generated
    sync()
    stats = {"peak": peak, "allocated": allocated, "free_at_end": cache.num_free_blocks}
    return out, generated, time.perf_counter() - t0, stats


class StepWithTensors(nn.Module):
    """``Model`` with the step's metadata as tensor arguments (what ``--package`` exports): ``max_seqlen_q`` is
    fixed at ``token_budget``, an upper bound of every padded step's query lengths (FlashAttention's varlen
    contract)."""

    def __init__(self, model: nn.Module, token_budget: int):
        super().__init__()
        self.model, self.max_seqlen_q = model, token_budget

    def forward(self, input_ids, positions, k_caches, v_caches, slot_mapping, cu_seqlens_q, seq_lens, block_table):
        meta = {"slot_mapping": slot_mapping, "cu_seqlens_q": cu_seqlens_q, "seq_lens": seq_lens,
                "block_table": block_table, "max_seqlen_q": self.max_seqlen_q}
        return self.model(input_ids, positions, k_caches, v_caches, meta)


class PackagedStep(AOTPackage):
    """``--package DIR``: the compiled step as an AOTInductor package instead of ``torch.compile``, called as the model.

    On the first call the step is exported (``StepWithTensors``; static shapes: ``serve`` pads every step to the same
    shapes), compiled with the same Inductor settings as the ``torch.compile`` path (``aoti_compile_and_package``,
    inside ``kvops.native.native_in_aoti_packages()`` so the package calls kvops' native CPU attention) and saved in
    DIR; a later process finds the file and only loads it, after checking its bytes against the sha256 recorded
    beside it at build time (``check_package``: a changed or corrupted package is refused, naming the file and the
    cure). This is the warm start that torch.compile's on-disk caches do not give a frozen graph in torch 2.13
    (docs/compile.md). The package holds the weights as constants (freezing), so its file name hashes everything
    baked in (``_common.package_path``): the arguments that shape the model and the step, dtype, device, threads,
    the CPU's vector ISA, the Inductor settings, kvops' lowering tag and the examples' source. Every call is checked
    against the inputs the package was built for (``_check_inputs``).
    """

    def __init__(self, model: nn.Module, args, directory: str):
        self.model, self.budget = model, args.token_budget
        key = {name: getattr(args, name) for name in ("device", "dtype", "layers", "vocab", "max_batch",
                                                        "token_budget", "max_prompt", "max_new", "block_size", "impl")}
        super().__init__(package_path(directory, "llm_serving", key, __file__))

    def __call__(self, input_ids, positions, k_caches, v_caches, meta):
        tensors = (input_ids, positions, list(k_caches), list(v_caches), meta["slot_mapping"], meta["cu_seqlens_q"],
                   meta["seq_lens"], meta["block_table"])
        signature = input_signature([("input_ids", input_ids), ("positions", positions),
                                     *((f"k_caches[{i}]", t) for i, t in enumerate(k_caches)),
                                     *((f"v_caches[{i}]", t) for i, t in enumerate(v_caches)),
                                     *((key, meta[key]) for key in ("slot_mapping", "cu_seqlens_q", "seq_lens",
                                                                    "block_table"))])
        if self.package is None and input_ids.device.type == "cpu":
            kvops.native.available()  # the native kernel the package calls (built or loaded once per process)
        return self.run(tensors, signature,
                        export=lambda: torch.export.export(StepWithTensors(self.model, self.budget), tensors),
                        context=kvops.native.native_in_aoti_packages)


def main() -> None:
    p = parser(__doc__)
    add_device_options(p)
    p.add_argument("--layers", type=int, default=2, help="transformer layers (24 in Qwen2.5-0.5B)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size (151936 in Qwen2.5-0.5B)")
    p.add_argument("--requests", type=int, default=10, help="requests served per run")
    p.add_argument("--max-batch", type=int, default=6, help="concurrent requests")
    p.add_argument("--token-budget", type=int, default=32, help="tokens per step (decode + one prefill chunk)")
    p.add_argument("--max-prompt", type=int, default=96, help="longest prompt (tokens); prompts are 3..this")
    p.add_argument("--max-new", type=int, default=24, help="most tokens generated per request (4..this)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per cache block")
    p.add_argument("--impl", default="kvops", choices=["kvops", "aten"],
                   help="kvops: paged_cache_write + paged_attention; aten: the baseline of plain index_put_ writes "
                        "and SDPA over the gathered blocks")
    add_run_options(p, "run", "the step", "the second run's first step: about 1.5 s here, load included")
    args = parse_run_args(p)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = Model(args.layers, args.vocab, args.impl).to(device, dtype).eval()
    gen = torch.Generator().manual_seed(1)
    specs = [
        (torch.randint(0, args.vocab, (int(torch.randint(3, args.max_prompt + 1, (), generator=gen)),),
                       generator=gen).tolist(),
         int(torch.randint(4, args.max_new + 1, (), generator=gen)))
        for _ in range(args.requests)
    ]
    blocks_per_req = -(-(args.max_prompt + args.max_new) // args.block_size)
    num_blocks = args.max_batch * blocks_per_req
    print(f"kvops {kvops.__version__}, torch {torch.__version__}, device {device}, dtype {dtype}, "
          f"{torch.get_num_threads()} threads, --impl {args.impl}")
    print(
        f"geometry: Qwen2.5-0.5B H_q {H_Q} / H_kv {H_KV} x head_dim {HEAD_DIM} (GQA 7:1), hidden {HIDDEN}, FFN {FFN}; "
        f"scaled for this run: {args.layers} layers (model: 24), vocab {args.vocab} (model: 151936), random weights"
    )
    print(
        f"workload: {args.requests} requests, prompts {min(len(s[0]) for s in specs)}-"
        f"{max(len(s[0]) for s in specs)} tokens, {sum(s[1] for s in specs)} tokens to generate; <= {args.max_batch} "
        f"concurrent; steps padded to {args.token_budget} tokens x {args.max_batch + 1} rows; "
        f"{num_blocks} blocks of {args.block_size} tokens per layer", flush=True
    )

    def run(fn):
        reserve = args.impl == "aten"  # block 0: scratch for the baseline's padding writes (slot 0)
        cache = PagedKVCache(num_blocks + reserve, args.block_size, H_KV, HEAD_DIM, num_layers=args.layers,
                             dtype=dtype, device=device)
        if reserve:
            cache.add_sequence("scratch")
            cache.extend("scratch", args.block_size)
        reqs = [Request(i, prompt, max_new) for i, (prompt, max_new) in enumerate(specs)]
        with torch.no_grad():
            return serve(fn, cache, reqs, args, device, sync)

    print("eager run (reference tokens, warm-up)...", flush=True)
    eager_out, n_tokens, _, peak = run(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # max_seqlen_q is an int that changes from step to step: mark it dynamic up front, else Dynamo specializes the
    # first graph on its first value and compiles a second, dynamic graph at the next step (twice the compile time).
    torch.compiler.config.dynamic_sources = "L['meta']['max_seqlen_q']"
    print(configure_cpu_inference_compile(device), flush=True)
    packaged = PackagedStep(model, args, args.package) if args.package else None
    compiled = packaged if packaged is not None else torch.compile(model, fullgraph=True)
    first_step = []

    def first_timed(*a):
        if first_step:
            return compiled(*a)
        t0, c0 = time.perf_counter(), cpu_seconds()
        out = compiled(*a)
        sync()
        first_step.extend([time.perf_counter() - t0, cpu_seconds() - c0])
        return out

    print(f"{'AOTInductor package: build or load' if packaged else 'compiling'} (first compiled step), then the first "
          f"compiled run...", flush=True)
    t0 = time.perf_counter()
    _, _, first_s, _ = run(first_timed)
    graphs_first = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # on-disk compile caches of the first step: with the CPU settings (freezing) torch 2.13 bypasses both the
    # AOTAutograd and the FX graph cache (docs/compile.md), so a second process traces again
    caches = {f"{group}.{key}": n for group in ("inductor", "aot_autograd")
              for key, n in torch._dynamo.utils.counters[group].items() if "cache" in key}
    print(f"  first compiled step {first_step[0]:.1f} s ({first_step[1]:.1f} s CPU), first compiled run "
          f"{time.perf_counter() - t0:.1f} s" + (f"; package {packaged.status}" if packaged else ""), flush=True)
    print(f"timed runs: {args.repeats} x (eager, compiled), interleaved...", flush=True)
    eager_tps, compiled_tps, ratios, same = [], [], [], True
    for r in range(args.repeats):
        order = [("eager", model), ("compiled", compiled)]
        pair = {}
        for name, fn in order if r % 2 == 0 else order[::-1]:  # alternate which goes first
            out, _, secs, _ = run(fn)
            pair[name] = n_tokens / secs
            same &= out == eager_out
        eager_tps.append(pair["eager"])
        compiled_tps.append(pair["compiled"])
        ratios.append(pair["compiled"] / pair["eager"])
        print(f"  pair {r + 1}: eager {pair['eager']:.1f} tokens/s, compiled {pair['compiled']:.1f} tokens/s "
              f"({ratios[-1]:.2f}x)", flush=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    print(f"greedy tokens identical eager vs compiled: {same} ({n_tokens} tokens over {len(eager_out)} requests)")
    if packaged:
        print(f"compilations: none by torch.compile (an AOTInductor package, {packaged.status.split()[0]}; first step "
              f"{first_step[0]:.1f} s)")
    else:
        print(f"compilations: {graphs_first} graph(s) in the first compiled run (first step {first_step[0]:.1f} s), "
              f"{graphs} after {args.repeats} more runs; compile caches: {caches}")
    print(f"tokens/s, median [min-max] of {args.repeats} interleaved runs: eager {spread(eager_tps)}, compiled "
          f"{spread(compiled_tps)}; compiled/eager per pair {spread(ratios, '{:.2f}')}x")
    print(f"blocks in use: peak {peak['peak']} of {num_blocks + (args.impl == 'aten')} per layer; {peak['allocated']} "
          f"block allocations over the run (freed blocks reused by later requests); {peak['free_at_end']} free at the "
          f"end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"example": "llm_serving", "impl": args.impl, "threads": torch.get_num_threads(),
                       "identical": same, "graphs_first": graphs_first, "graphs": graphs,
                       "first_step_s": first_step[0], "first_step_cpu_s": first_step[1], "first_run_s": first_s,
                       "compile_caches": caches, "package": packaged and packaged.status,
                       "eager_tokens_per_s": eager_tps, "compiled_tokens_per_s": compiled_tps, "ratios": ratios}, f)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

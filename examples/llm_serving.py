"""Serving a batch of requests on a paged KV cache: chunked prefill + decode, eager vs torch.compile(fullgraph=True).

A decoder-only transformer with the attention geometry of Qwen2.5-0.5B (models.md: 14 query heads / 2 KV heads x
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

import argparse
import hashlib
import json
import os
import pathlib
import statistics
import tempfile
import time
from collections import deque

import torch
import torch._dynamo
import torch._inductor.config
import torch.nn.functional as F
from torch import nn

import kvops
from kvops.cache import PagedKVCache

# Qwen2.5-0.5B (models.md / its config.json)
HIDDEN, H_Q, H_KV, HEAD_DIM, FFN, ROPE_THETA = 896, 14, 2, 64, 4864, 1_000_000.0


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (half-split, as Qwen2/Llama) of ``x [N, H, D]`` at ``positions [N]``."""
    d = x.shape[-1] // 2
    inv_freq = ROPE_THETA ** (-torch.arange(d, device=x.device, dtype=torch.float32) / d)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


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
        q = rope(q.view(n, H_Q, HEAD_DIM), positions)
        k = rope(k.view(n, H_KV, HEAD_DIM), positions)
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


def configure_cpu_inference_compile(device: torch.device) -> str:
    """Inductor settings for the compiled CPU path (set in ``main`` only; returned as a line to print).

    Both examples are GEMM-bound at their CPU scale (``aten::addmm``/``mm`` are ~90% of an eager step, measured with
    torch.profiler), and by default Inductor calls the same GEMM as eager. Under ``torch.no_grad``, ``freezing``
    turns the weights into constants (constant folding, weight prepacking) and ``max_autotune`` with the ``CPP``
    GEMM backend only (one candidate, so nothing is benchmarked at compile time) generates a GEMM over the prepacked
    weights with the bias/activation fused in. Only parameters are frozen: the KV caches are arguments of the
    compiled function (mutated graph inputs), never constants. Weight updates after the first compiled call are not
    seen by the compiled model (freezing's contract). Cost: torch 2.13 caches no frozen graph on disk (AOTAutograd
    and FX graph caches bypass it), so every process traces and generates code again (docs/compile.md).
    """
    if device.type != "cpu":
        return "inductor: defaults"
    torch._inductor.config.freezing = True
    torch._inductor.config.max_autotune = True
    torch._inductor.config.max_autotune_gemm_backends = "CPP"
    return "inductor: freezing, max_autotune with the CPP GEMM backend (weights prepacked; caches are inputs)"


def kvops_sources() -> str:
    """sha256 of kvops' version and installed sources (``.py``, ``.cpp``, ``.h``), for ``--package`` file names: a
    package bakes in kvops code (lowerings, the ops' schemas, ``streaming_update``), so a changed kvops builds anew."""
    root = pathlib.Path(kvops.__file__).parent
    digest = hashlib.sha256(kvops.__version__.encode())
    for f in sorted(root.rglob("*")):
        if f.suffix in (".py", ".cpp", ".h"):
            digest.update(f.relative_to(root).as_posix().encode() + f.read_bytes())
    return digest.hexdigest()


def input_signature(named) -> dict:
    """``{name: [shape, dtype, device]}`` of ``(name, tensor)`` pairs: what a ``--package`` records in its metadata
    (as JSON) and checks every call against."""
    return {name: [list(t.shape), str(t.dtype), str(t.device)] for name, t in named}


def digest_path(path: pathlib.Path) -> pathlib.Path:
    """Where a package's sha256 is recorded when it is built: ``<package>.sha256`` beside it."""
    return path.with_name(path.name + ".sha256")


def file_digest(path: pathlib.Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks (about 1-2 s per GB, once per process)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_package(path: pathlib.Path) -> None:
    """SystemExit naming the file and the cure unless ``path`` has the bytes whose sha256 was recorded when it was
    built: AOTInductor loads a package whose weights were changed (even with a stale zip CRC) and runs it."""
    record = digest_path(path)
    try:
        recorded = record.read_text().strip()
    except OSError as e:
        raise SystemExit(f"--package: {path} has no readable digest record {record.name} (written beside it when it is "
                         f"built; {e.strerror}); delete {path.name} to rebuild it") from e
    if file_digest(path) != recorded:
        raise SystemExit(f"--package: {path} does not match the sha256 recorded in {record.name} when it was built: "
                         f"the file was changed or corrupted; delete {path.name} and {record.name} to rebuild it")


def writable_package_dir(path: pathlib.Path) -> None:
    """Make sure a package that is not there yet can be built in its folder (else SystemExit naming the folder)."""
    if path.exists():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--package: cannot create {path.parent} to build {path.name} ({e})") from e
    if not os.access(path.parent, os.W_OK):
        raise SystemExit(f"--package: cannot build {path.name} in {path.parent}: the folder is not writable")


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


class PackagedStep:
    """``--package DIR``: the compiled step as an AOTInductor package instead of ``torch.compile``, called as the model.

    On the first call the step is exported (``StepWithTensors``; static shapes: ``serve`` pads every step to the same
    shapes), compiled with the same Inductor settings as the ``torch.compile`` path (``aoti_compile_and_package``,
    inside ``kvops.native.native_in_aoti_packages()`` so the package calls kvops' native CPU attention) and saved in
    DIR; a later process finds the file and only loads it, after checking its bytes against the sha256 recorded
    beside it at build time (``check_package``: a changed or corrupted package is refused, naming the file and the
    cure). This is the warm start that torch.compile's on-disk caches do not give a frozen graph in torch 2.13
    (docs/compile.md). The package holds the weights as constants (freezing),
    so its file name hashes everything baked in: the arguments that shape the model and the step, dtype, device,
    threads, the CPU's vector ISA, the Inductor settings, kvops' lowering tag and this file's source.
    """

    def __init__(self, model: nn.Module, args, directory: str):
        self.model, self.budget, self.package, self.status, self.signature = model, args.token_budget, None, None, {}
        key = {name: getattr(args, name) for name in ("device", "dtype", "layers", "vocab", "max_batch",
                                                        "token_budget", "max_prompt", "max_new", "block_size", "impl")}
        key.update(threads=torch.get_num_threads(), isa=torch.backends.cpu.get_cpu_capability(),
                   torch=torch.__version__, tag=torch.compiler.config.cache_key_tag,
                   inductor=[torch._inductor.config.freezing, torch._inductor.config.max_autotune,
                             torch._inductor.config.max_autotune_gemm_backends],
                   source=hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest(), kvops=kvops_sources())
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = pathlib.Path(directory) / f"llm_serving-{digest}.pt2"
        writable_package_dir(self.path)

    def __call__(self, input_ids, positions, k_caches, v_caches, meta):
        tensors = (input_ids, positions, list(k_caches), list(v_caches), meta["slot_mapping"], meta["cu_seqlens_q"],
                   meta["seq_lens"], meta["block_table"])
        signature = input_signature([("input_ids", input_ids), ("positions", positions),
                                     *((f"k_caches[{i}]", t) for i, t in enumerate(k_caches)),
                                     *((f"v_caches[{i}]", t) for i, t in enumerate(v_caches)),
                                     *((key, meta[key]) for key in ("slot_mapping", "cu_seqlens_q", "seq_lens",
                                                                    "block_table"))])
        if self.package is None:
            from torch._inductor import aoti_compile_and_package, aoti_load_package

            if input_ids.device.type == "cpu":
                kvops.native.available()  # the native kernel the package calls (built or loaded once per process)
            if self.path.exists():
                self.status = f"loaded {self.path}"
            else:  # (writable_package_dir made the folder)
                exported = torch.export.export(StepWithTensors(self.model, self.budget), tensors)
                metadata = {"aot_inductor.metadata": {"kvops_inputs": json.dumps(signature)}}  # checked on load
                with tempfile.TemporaryDirectory(prefix=".building-", dir=self.path.parent) as tmp:  # no half file
                    with kvops.native.native_in_aoti_packages():
                        built = pathlib.Path(aoti_compile_and_package(
                            exported, package_path=os.path.join(tmp, self.path.name), inductor_configs=metadata))
                    digest_path(built).write_text(file_digest(built) + "\n")  # checked at every load
                    os.replace(digest_path(built), digest_path(self.path))  # (a record without its package: rebuilt)
                    os.replace(built, self.path)
                self.status = f"built {self.path}"
            check_package(self.path)
            try:
                self.package = aoti_load_package(str(self.path))
                self.signature = json.loads(self.package.get_metadata()["kvops_inputs"])
            except (RuntimeError, KeyError) as e:
                raise SystemExit(f"--package: {self.path} could not be loaded ({e!r}); delete it to rebuild it") from e
        self._check_inputs(signature)
        return self.package(*tensors)

    def _check_inputs(self, signature: dict) -> None:
        """Refuse (ValueError, before the package runs) inputs whose shape, dtype or device differ from those the
        package was built for (its metadata records them): its generated code indexes with the built shapes, and
        AOTInductor checks none at run time unless ``AOTI_RUNTIME_CHECK_INPUTS=1``, so other inputs would be read and
        written out of bounds."""
        if signature != self.signature:
            name = next(n for n in {**signature, **self.signature} if signature.get(n) != self.signature.get(n))
            raise ValueError(f"{type(self).__name__}: {name} is {signature.get(name)} (shape, dtype, device), but "
                             f"{self.path.name} was built for {self.signature.get(name)}: pass inputs of those "
                             f"shapes, or build another package (other arguments)")


def spread(values, fmt="{:.1f}") -> str:
    """``median [min-max] (n runs)`` of a list of measurements."""
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (Inductor's C++ compiler runs): a compile-cost measure
    that other load on the machine does not inflate as it does wall time."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="model and cache dtype")
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
    p.add_argument("--repeats", type=int, default=3,
                   help="timed eager/compiled run pairs after warm-up, interleaved (median and spread printed)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--package", default=None, metavar="DIR",
                   help="compiled = an AOTInductor package of the step (same Inductor settings) instead of "
                        "torch.compile: built and saved in DIR on the first run, loaded from DIR by later runs with "
                        "the same arguments (the second run's first step: about 1.5 s here, load included)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the measurements to this JSON file")
    args = p.parse_args()
    if args.package and os.path.exists(args.package) and not os.path.isdir(args.package):
        p.error(f"--package {args.package}: not a directory (give a folder for the packages)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but CUDA is not available")
    if args.threads:
        torch.set_num_threads(args.threads)
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

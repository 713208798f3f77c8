"""Streaming block-causal generation on kvops' CausalKVCache, eager vs torch.compile(fullgraph=True).

A block-causal transformer with the attention geometry of Wan-2.1 1.3B (12 heads x 128, qk-norm, RoPE;
models.md) streams video latents chunk by chunk, as in Self-Forcing / CausVid: every chunk of 3 frames goes through
several denoising steps (the first step appends the chunk to each layer's cache, later steps rewrite it in place),
then a clean "context" pass rewrites it once more. Two cache configurations run: Wan-style (no sink, window of 21
frames) and a LingBot-style attention sink of 3 frames (window of 21 frames, so the sink matters).

Scaled to a 2-core CPU (and printed as such): tokens per frame (1560 at 480x832 -> --tokens-per-frame), layers
(30 -> --layers), FFN width (8960 -> --ffn), chunks per stream (--chunks); the head geometry and the
sink/chunk/window ratios are the model's.

Printed: each phase as it starts (flushed); max |eager - compiled| over every chunk output, compilations, per-chunk
latency eager vs compiled (after warm-up; median and spread of interleaved streams, `--repeats`), and the resident
cache bytes. `--impl aten` runs the same model on plain slice-copy caches (the compile-cost baseline).

    python examples/streaming_video.py                 # CPU, about a minute on 2 cores
    python examples/streaming_video.py --kv-cache-quant int8 fp8 int4 int2   # + packed (quantized) caches
    python examples/streaming_video.py --layout ring   # RingCausalKVCache (issue 12 §3), compared with the roll layout
    python examples/streaming_video.py --device cuda --dtype bfloat16 --tokens-per-frame 1560 --layers 30 --ffn 8960
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import NamedTuple

import torch
import torch._dynamo
import torch._inductor.config
import torch.nn.functional as F
from torch import nn

import kvops
from kvops.cache import CausalKVCache, PackedCausalKVCache, RingCausalKVCache
from kvops.packed import packed_attention

# Wan-2.1 1.3B (models.md): 12 heads x 128 = dim 1536, FFN 8960, 30 layers; chunk 3 frames, window 21 frames.
HEADS, HEAD_DIM = 12, 128
CONFIGS = {  # name: (sink frames, chunk frames, window frames)
    "wan2.1-1.3b (no sink)": (0, 3, 21),
    "lingbot-style sink": (3, 3, 21),
}


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """1-D rotary embedding of ``x [B, n, H, D]`` at token ``positions [n]`` (global positions, so a chunk gets the
    same embedding on every rewrite)."""
    d = x.shape[-1] // 2
    inv_freq = 10000.0 ** (-torch.arange(d, device=x.device, dtype=torch.float32) / d)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class AtenView(NamedTuple):
    k: torch.Tensor
    v: torch.Tensor


class AtenCausalCache:
    """The ``--impl aten`` baseline: this example's use of ``CausalKVCache`` (append a chunk at the end or rewrite the
    newest chunk; when full, evict the oldest rows after the sink) with plain slice copies, Python-int cursors."""

    def __init__(self, batch: int, size: int, sink_tokens: int, dtype, device, fused_kv: bool = True):
        if fused_kv:  # K and V: views of one allocation, as CausalKVCache.allocate(fused_kv=True)
            kv = torch.zeros(batch, size, 2, HEADS, HEAD_DIM, dtype=dtype, device=device)
            self.k, self.v = kv[:, :, 0], kv[:, :, 1]
        else:
            self.k, self.v = (torch.zeros(batch, size, HEADS, HEAD_DIM, dtype=dtype, device=device) for _ in "kv")
        self.sink, self.global_end, self.local_end = sink_tokens, 0, 0

    def reset_indices(self) -> None:
        self.global_end = self.local_end = 0

    def update_and_get_attention_kv(self, k: torch.Tensor, v: torch.Tensor, current_chunk_start: int):
        n = k.shape[1]
        if current_chunk_start == self.global_end:  # append (evicting first when the chunk does not fit)
            over = self.local_end + n - self.k.shape[1]
            if over > 0:
                for buf in (self.k, self.v):
                    buf[:, self.sink : self.local_end - over] = buf[:, self.sink + over : self.local_end].clone()
                self.local_end -= over
            self.global_end += n
            self.local_end += n
        start = self.local_end - (self.global_end - current_chunk_start)
        self.k[:, start : start + n] = k
        self.v[:, start : start + n] = v
        return AtenView(self.k[:, : self.local_end], self.v[:, : self.local_end])


class Block(nn.Module):
    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.q_norm, self.k_norm = nn.RMSNorm(HEAD_DIM), nn.RMSNorm(HEAD_DIM)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(approximate="tanh"), nn.Linear(ffn, dim))

    def forward(self, x: torch.Tensor, cache: CausalKVCache, start: int) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, HEADS, HEAD_DIM).unbind(2)
        positions = torch.arange(n, device=x.device) + start
        q, k = rope(self.q_norm(q), positions), rope(self.k_norm(k), positions)
        if isinstance(cache, PackedCausalKVCache):  # --kv-cache-quant: attend to the packed segments directly
            view = cache.update(k, v, current_chunk_start=start)
            attn = packed_attention(q, view.k, view.v).transpose(1, 2)
        else:
            # The K/V write (append, rewrite or evict-and-append) happens here; the chunk sees the visible window.
            # With --layout ring the view is in ring order: fine here, the attention is unmasked over the window and
            # RoPE was applied before the write (RingKVView's docstring).
            view = cache.update_and_get_attention_kv(k, v, current_chunk_start=start)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), view.k.transpose(1, 2), view.v.transpose(1, 2))
        x = x + self.out(attn.transpose(1, 2).reshape(b, n, -1))
        return x + self.ffn(self.norm2(x))


class StreamingModel(nn.Module):
    """Holds the weights only: the caches are passed to ``forward`` (see CausalKVCache's docstring: int cursors
    reached through a module attribute would be constants to Dynamo and recompile every chunk)."""

    def __init__(self, layers: int, ffn: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(HEADS * HEAD_DIM, ffn) for _ in range(layers))

    def forward(self, x: torch.Tensor, caches: list[CausalKVCache], start: int) -> torch.Tensor:
        for block, cache in zip(self.blocks, caches):
            x = block(x, cache, start)
        return x


def stream(model, caches, latents: torch.Tensor, chunk_tokens: int, steps: int, sync):
    """Generate every chunk of ``latents [B, T, dim]`` (the noise): ``steps`` denoising passes + one context pass.

    Returns the denoised chunks and the wall time of each chunk (seconds)."""
    outputs, times = [], []
    for s in range(0, latents.shape[1], chunk_tokens):
        t0 = time.perf_counter()
        x = latents[:, s : s + chunk_tokens].contiguous()  # same strides as the denoised x of later steps
        for step in range(steps):  # step 0 appends the chunk, the later steps rewrite it in place
            x = x - (0.5 / steps) * model(x, caches, s)
        model(x, caches, s)  # clean context pass: rewrites the chunk's K/V with the denoised tokens
        sync()
        times.append(time.perf_counter() - t0)
        outputs.append(x)
    return torch.cat(outputs, dim=1), times


def configure_cpu_inference_compile(device: torch.device) -> str:
    """Inductor settings for the compiled CPU path (set in ``main`` only; returned as a line to print).

    Both examples are GEMM-bound at their CPU scale (``aten::addmm``/``mm`` are ~90% of an eager step, measured with
    torch.profiler), and by default Inductor calls the same GEMM as eager. Under ``torch.no_grad``, ``freezing``
    turns the weights into constants (constant folding, weight prepacking) and ``max_autotune`` with the ``CPP``
    GEMM backend only (one candidate, so nothing is benchmarked at compile time) generates a GEMM over the prepacked
    weights with the bias/activation fused in. Only parameters are frozen: the KV caches are arguments of the
    compiled function (mutated graph inputs), never constants. Weight updates after the first compiled call are not
    seen by the compiled model (freezing's contract). torch 2.13's freezing fails to compile a graph whose mutated
    inputs are views of one tensor (reproduced without kvops: a module writing ``k[:, :4] = h; v[:, :4] = 2 * h``
    with ``k, v = kv[:, :, 0], kv[:, :, 1]`` raises IndexError under freezing and compiles without it), so with
    freezing on, this example allocates K and V separately. Cost: torch 2.13 caches no frozen graph on disk, so
    every process traces and generates code again (docs/compile.md).
    """
    if device.type != "cpu":
        return "inductor: defaults"
    torch._inductor.config.freezing = True
    torch._inductor.config.max_autotune = True
    torch._inductor.config.max_autotune_gemm_backends = "CPP"
    return "inductor: freezing, max_autotune with the CPP GEMM backend (weights prepacked; caches are inputs)"


def spread(values, fmt="{:.1f}") -> str:
    """``median [min-max]`` of a list of measurements."""
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (Inductor's C++ compiler runs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="model and cache dtype")
    p.add_argument("--layers", type=int, default=2, help="30 in Wan-2.1 1.3B")
    p.add_argument("--tokens-per-frame", type=int, default=8, help="1560 at 480x832")
    p.add_argument("--ffn", type=int, default=2240, help="FFN width (8960 in Wan-2.1 1.3B)")
    p.add_argument("--chunks", type=int, default=10, help="chunks per stream (must pass the window to evict)")
    p.add_argument("--steps", type=int, default=3, help="denoising steps per chunk (DMD: 3-4)")
    p.add_argument("--kv-cache-quant", default=["off"], nargs="+", choices=["off", "int8", "fp8", "int4", "int2"],
                   help="also stream (eager) on a PackedCausalKVCache in this format (or these formats) and compare "
                        "with the dense run")
    p.add_argument("--layout", default="roll", choices=["roll", "ring"],
                   help="cache layout: roll (CausalKVCache) or ring (RingCausalKVCache; its eager output is also "
                        "compared with the roll layout's)")
    p.add_argument("--impl", default="kvops", choices=["kvops", "aten"],
                   help="kvops: CausalKVCache (kvops.cache_write / cache_roll); aten: the baseline of plain slice "
                        "copies with the same semantics (roll layout, dense runs only)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed eager/compiled stream pairs after warm-up, interleaved (median and spread printed)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the measurements to this JSON file")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but CUDA is not available")
    if args.impl == "aten" and (args.layout != "roll" or args.kv_cache_quant != ["off"]):
        raise SystemExit("--impl aten is the dense roll-layout baseline: use it without --layout ring and "
                         "--kv-cache-quant")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = StreamingModel(args.layers, args.ffn).to(device, dtype).eval()
    tpf = args.tokens_per_frame
    print(f"kvops {kvops.__version__}, torch {torch.__version__}, device {device}, dtype {dtype}, "
          f"{torch.get_num_threads()} threads, --impl {args.impl}")
    print(
        f"geometry: Wan-2.1 1.3B heads {HEADS} x head_dim {HEAD_DIM}; scaled for this run: {args.layers} layers "
        f"(model: 30), FFN {args.ffn} (model: 8960), {tpf} tokens/frame (model: 1560 at 480x832), {args.chunks} chunks, "
        f"{args.steps} denoising steps + 1 context pass per chunk", flush=True
    )
    print(configure_cpu_inference_compile(device), flush=True)
    compiled = torch.compile(model, fullgraph=True)
    # K and V as views of one allocation (fused_kv) are aliased mutated graph inputs, which Inductor's freezing
    # mishandles in torch 2.13 (configure_cpu_inference_compile): separate K and V buffers when freezing.
    fused_kv = not torch._inductor.config.freezing
    # compiled matmuls/RMSNorm may round differently from eager; the cache data movement itself is bit-exact (tests)
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
    ok, results = True, {}
    for name, (sink_f, chunk_f, window_f) in CONFIGS.items():
        chunk_tokens = chunk_f * tpf
        latents = torch.randn(1, args.chunks * chunk_tokens, HEADS * HEAD_DIM, device=device, dtype=dtype)

        def fresh_caches(cls=RingCausalKVCache if args.layout == "ring" else CausalKVCache):
            if args.impl == "aten":
                return [AtenCausalCache(1, window_f * tpf, sink_f * tpf, dtype, device, fused_kv)
                        for _ in range(args.layers)]
            return [
                cls.allocate(
                    1, window_f * tpf, HEADS, HEAD_DIM, dtype=dtype, device=device, fused_kv=fused_kv,
                    sink_tokens=sink_f * tpf,
                )
                for _ in range(args.layers)
            ]

        print(f"\n== {name}: sink {sink_f} / chunk {chunk_f} / window {window_f} frames = "
              f"{sink_f * tpf} / {chunk_tokens} / {window_f * tpf} tokens", flush=True)
        with torch.no_grad():
            print("  eager stream (reference, warm-up)...", flush=True)
            eager_caches = fresh_caches()
            eager_out, _ = stream(model, eager_caches, latents, chunk_tokens, args.steps, sync)
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            compiled_caches = fresh_caches()
            print("  compiling (first compiled stream: every graph compiles in its first chunks)...", flush=True)
            t0, c0 = time.perf_counter(), cpu_seconds()
            compiled_out, first_times = stream(compiled, compiled_caches, latents, chunk_tokens, args.steps, sync)
            first_stream, first_cpu = time.perf_counter() - t0, cpu_seconds() - c0
            graphs_first = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            print(f"  first compiled stream {first_stream:.1f} s ({first_cpu:.1f} s CPU; first chunk "
                  f"{first_times[0]:.1f} s), {graphs_first} graphs", flush=True)
            print(f"  timed streams: {args.repeats} x (eager, compiled) on reset caches, interleaved...", flush=True)
            warm = slice(args.chunks // 2, None)  # after the window filled up and eviction started
            eager_ms, compiled_ms, ratios = [], [], []
            for r in range(args.repeats):
                pair = {}
                order = [("eager", model, eager_caches), ("compiled", compiled, compiled_caches)]
                for label, fn, caches in order if r % 2 == 0 else order[::-1]:
                    for cache in caches:  # a stream on the same (reset) caches reuses the compiled graphs
                        cache.reset_indices()
                    out, times = stream(fn, caches, latents, chunk_tokens, args.steps, sync)
                    pair[label] = 1e3 * statistics.median(times[warm])
                    if label == "compiled":
                        compiled_out2 = out
                    else:
                        eager_times = times  # the latest eager stream's chunk times, for --kv-cache-quant
                eager_ms.append(pair["eager"])
                compiled_ms.append(pair["compiled"])
                ratios.append(pair["eager"] / pair["compiled"])
                print(f"    pair {r + 1}: eager {pair['eager']:.1f} ms/chunk, compiled {pair['compiled']:.1f} ms/chunk "
                      f"({ratios[-1]:.2f}x)", flush=True)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

        diff = (eager_out.float() - compiled_out.float()).abs().max().item()
        if args.layout == "ring":  # the same stream on the roll layout (eager): ring order must not change the output
            with torch.no_grad():
                roll_out, _ = stream(model, fresh_caches(CausalKVCache), latents, chunk_tokens, args.steps, sync)
            layout_diff = (eager_out.float() - roll_out.float()).abs().max().item()
        diff2 = (compiled_out.float() - compiled_out2.float()).abs().max().item()
        kv_diff = max(
            (e.k.float() - c.k.float()).abs().max().item() for e, c in zip(eager_caches, compiled_caches)
        )
        cache_bytes = sum(c.k.untyped_storage().nbytes() + (not fused_kv) * c.v.untyped_storage().nbytes()
                          for c in compiled_caches)  # fused: K and V share one allocation
        within = diff <= tol and kv_diff <= tol
        ok &= within and graphs == graphs_first
        print(f"  max |eager - compiled| over all chunk outputs: {diff:.3e}, final caches' K: {kv_diff:.3e} "
              f"(tolerance {tol:g} for {dtype}: {'OK' if within else 'EXCEEDED'})")
        if args.layout == "ring":
            ok &= layout_diff <= tol
            print(f"  layout ring vs roll (eager): max |ring - roll| over all chunk outputs: {layout_diff:.3e} "
                  f"(tolerance {tol:g}: {'OK' if layout_diff <= tol else 'EXCEEDED'})")
        print(f"  compilations: {graphs_first} graphs in the first stream of {args.chunks} chunks x "
              f"{args.steps + 1} passes; {graphs} after a second stream on reset caches "
              f"(second stream equals the first: max diff {diff2:.1e})")
        print(f"  per-chunk latency (median over chunks {warm.start + 1}-{args.chunks} of a stream), median [min-max] "
              f"of "
              f"{args.repeats} interleaved streams: eager {spread(eager_ms)} ms, compiled {spread(compiled_ms)} ms; "
              f"eager/compiled per pair {spread(ratios, '{:.2f}')}x; first compiled stream incl. compilation "
              f"{first_stream:.1f} s")
        results[name] = {"graphs_first": graphs_first, "graphs": graphs, "first_stream_s": first_stream,
                         "first_stream_cpu_s": first_cpu, "first_chunk_s": first_times[0], "eager_ms": eager_ms,
                         "compiled_ms": compiled_ms, "ratios": ratios, "max_diff": diff, "within_tolerance": within}
        print(f"  resident cache: {cache_bytes / 2**20:.2f} MiB for {args.layers} layers "
              f"({cache_bytes // args.layers} bytes/layer: [1, {window_f * tpf}, 2, {HEADS}, {HEAD_DIM}] {dtype})")
        for quant in args.kv_cache_quant:
            if quant != "off":
                compare_packed(model, latents, args, quant, eager_out, eager_times, cache_bytes, sink_f * tpf,
                               chunk_tokens, window_f * tpf, dtype, device, sync)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"example": "streaming_video", "impl": args.impl, "threads": torch.get_num_threads(),
                       "ok": ok, "configs": results}, f)
    if not ok:
        raise SystemExit("eager and compiled (or ring and roll) disagree beyond tolerance, or the second stream "
                         "recompiled")


# --- --kv-cache-quant: the same stream on kvops.packed.PackedCausalKVCache (eager), vs the dense eager run -------
def compare_packed(model, latents, args, quant, dense_out, dense_times, dense_bytes, sink, chunk, window, dtype, device,
                   sync):
    """Stream again with packed caches (the newest completed chunk dense, older ones in ``--kv-cache-quant``;
    attention reads the packed segments, kvops.packed.packed_attention) and print memory, time and the output's
    difference and PSNR vs the dense run (PSNR over the denoised latents, peak = max |dense|)."""
    caches = [
        PackedCausalKVCache.allocate(1, window, HEADS, HEAD_DIM, chunk_tokens=chunk, quant=quant,
                                     keep_recent_chunks=1, sink_tokens=sink, dtype=dtype, device=device)
        for _ in range(args.layers)
    ]
    with torch.no_grad():
        out, times = stream(model, caches, latents, chunk, args.steps, sync)
    packed_bytes = sum(c.nbytes for c in caches)
    err = (out.float() - dense_out.float()).pow(2).mean().item()
    peak = dense_out.float().abs().max().item()
    psnr = 10 * math.log10(peak**2 / err) if err > 0 else float("inf")
    warm = slice(len(times) // 2, None)
    ms = lambda ts: 1e3 * sum(ts) / len(ts)  # noqa: E731
    print(f"  --kv-cache-quant {quant} (eager, keep_recent_chunks=1): resident cache "
          f"{packed_bytes / 2**20:.2f} MiB ({packed_bytes / dense_bytes:.3f}x dense); per-chunk latency after warm-up "
          f"{ms(times[warm]):.1f} ms vs dense eager {ms(dense_times[warm]):.1f} ms "
          f"({ms(times[warm]) / ms(dense_times[warm]):.2f}x); output vs dense: max |diff| "
          f"{(out.float() - dense_out.float()).abs().max().item():.3e}, PSNR {psnr:.1f} dB")


if __name__ == "__main__":
    main()

"""Streaming block-causal generation on kvops' CausalKVCache, eager vs torch.compile(fullgraph=True).

A block-causal transformer with the attention geometry of Wan-2.1 1.3B (12 heads x 128, qk-norm, RoPE;
docs/models.md) streams video latents chunk by chunk, as in Self-Forcing / CausVid: every chunk of 3 frames goes through
several denoising steps (the first step appends the chunk to each layer's cache, later steps rewrite it in place),
then a clean "context" pass rewrites it once more. Two cache configurations run: Wan-style (no sink, window of 21
frames) and a LingBot-style attention sink of 3 frames (window of 21 frames, so the sink matters).

Scaled to a 2-core CPU (and printed as such): tokens per frame (1560 at 480x832 -> --tokens-per-frame), layers
(30 -> --layers), FFN width (8960 -> --ffn), chunks per stream (--chunks); the head geometry and the
sink/chunk/window ratios are the model's.

Printed: each phase as it starts (flushed); max |eager - compiled| over every chunk output, compilations, per-chunk
latency eager vs compiled (after warm-up; median and spread of interleaved streams, `--repeats`), and the resident
cache bytes. `--impl aten` runs the same model on plain slice-copy caches (the compile-cost baseline). `--package DIR`:
the compiled path is an AOTInductor package per cache configuration (``StreamStep``: tensor cursors), built and saved
in DIR by the first run and loaded by later ones (torch.compile re-traces a frozen graph in every process).

    python examples/streaming_video.py                 # CPU, about a minute on 2 cores
    python examples/streaming_video.py --kv-cache-quant int8 fp8 int4 int2   # + packed (quantized) caches
    python examples/streaming_video.py --layout ring   # docs/ring-cache.md, compared with the roll layout
    python examples/streaming_video.py --package /tmp/video-packages   # twice: the second run loads the packages
    python examples/streaming_video.py --device cuda --dtype bfloat16 --tokens-per-frame 1560 --layers 30 --ffn 8960
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
import sys
import time
from typing import NamedTuple

import torch
import torch._dynamo
import torch._inductor.config
import torch.nn.functional as F
from torch import nn

import kvops
from kvops.cache import CausalKVCache, PackedCausalKVCache, RingCausalKVCache
from kvops.export import init_cursors, streaming_update
from kvops.packed import packed_attention

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # examples/_common.py, from any working directory
from _common import (AOTPackage, add_device_options, add_run_options, check_package,  # noqa: E402,F401
                     configure_cpu_inference_compile, cpu_seconds, input_signature, parse_run_args, parser, spread)
from _common import package_path as _package_path  # noqa: E402

# Wan-2.1 1.3B (docs/models.md): 12 heads x 128 = dim 1536, FFN 8960, 30 layers; chunk 3 frames, window 21 frames.
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

    def reset(self) -> None:
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
        q, k, v = self.project(x, start)
        if isinstance(cache, PackedCausalKVCache):  # --kv-cache-quant: attend to the packed segments directly
            view = cache.update(k, v, current_chunk_start=start)
            attn = packed_attention(q, view.k, view.v).transpose(1, 2)
        else:
            # The K/V write (append, rewrite or evict-and-append) happens here; the chunk sees the visible window.
            # With --layout ring the view is in ring order: fine here, the attention is unmasked over the window and
            # RoPE was applied before the write (RingKVView's docstring).
            view = cache.update_and_get_attention_kv(k, v, current_chunk_start=start)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), view.k.transpose(1, 2), view.v.transpose(1, 2))
        return self.finish(x, attn.transpose(1, 2))

    def project(self, x: torch.Tensor, start) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, n, dim]`` at global position ``start`` (int or int64 ``[]``) -> q, k, v ``[B, n, H, D]`` (RoPE'd
        q and k)."""
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, HEADS, HEAD_DIM).unbind(2)
        positions = torch.arange(n, device=x.device) + start
        return rope(self.q_norm(q), positions), rope(self.k_norm(k), positions), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection of ``attn [B, n, H, D]``, residuals and FFN."""
        x = x + self.out(attn.reshape(*x.shape[:2], -1))
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


# --- --package: the pass with tensor cursors (kvops.export.streaming_update), exported and AOTInductor-compiled ----
def aten_streaming_update(key, value, k_cache, v_cache, cursors, current_chunk_start, *, sink_tokens: int = 0):
    """``--impl aten --package``: ``kvops.export.streaming_update``'s update (window = the whole cache) in plain aten
    ops, as ``AtenCausalCache`` is ``CausalKVCache``'s: the eviction gathers the whole cache (``index_select``), the
    chunk is written with ``index_copy_``; no position checks. Same arguments and results ``(mask [S], cursors)``."""
    n, size = key.shape[1], k_cache.shape[1]
    g, l, s = cursors[0], cursors[1], current_chunk_start
    added = (s + n - g).clamp(min=0)
    evicted = (l + added - size).clamp(min=0)
    new_l = l + added - evicted
    rows = torch.arange(size, device=k_cache.device)
    src = torch.where((rows >= sink_tokens) & (rows < l - evicted), rows + evicted, rows)  # evict: rows move down
    dst = new_l - (g + added - s) + torch.arange(n, device=k_cache.device)  # the chunk's rows after the update
    for cache, new in ((k_cache, key), (v_cache, value)):
        cache.copy_(cache.index_select(1, src))
        cache.index_copy_(1, dst, new)
    return rows < new_l, torch.stack([g + added, new_l])


class StreamStep(nn.Module):
    """One pass of ``StreamingModel`` over a chunk with the caches as tensors (what ``--package`` exports, also
    tests/export/test_aoti.py and test_onnx.py): ``(x [B, n, dim], k_caches, v_caches (lists of [B, S, H, D], zero-initialized,
    mutated), cursors int64 [2], start int64 []) -> (x, new_cursors, *k_caches, *v_caches, *chunk_keys,
    *chunk_values)``. Every layer shares the cursors (they advance identically); attention is SDPA over the whole
    cache with ``streaming_update``'s row mask, so one program serves appends, rewrites and evicting appends. The
    caches are returned for ONNX (no in-place inputs), the chunk's K/V so a test can replay the updates eagerly."""

    def __init__(self, model: StreamingModel, sink_tokens: int, update=streaming_update):
        super().__init__()
        self.blocks, self.sink_tokens, self.update = model.blocks, sink_tokens, update

    def forward(self, x, k_caches, v_caches, cursors, start):
        new_cursors, keys, values = cursors, [], []
        for block, k_cache, v_cache in zip(self.blocks, k_caches, v_caches):
            q, k, v = block.project(x, start)
            mask, new_cursors = self.update(k, v, k_cache, v_cache, cursors, start, sink_tokens=self.sink_tokens)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                                  attn_mask=mask[None, :])
            x = block.finish(x, attn.transpose(1, 2))
            keys.append(k)
            values.append(v)
        return (x, new_cursors, *k_caches, *v_caches, *keys, *values)


class TensorCursorCache(NamedTuple):
    """A layer's K and V ``[1, S, H, D]`` for ``PackagedStep``; the layers of a stream share ``cursors``."""
    k: torch.Tensor
    v: torch.Tensor
    cursors: torch.Tensor

    def reset(self) -> None:
        self.cursors.zero_()  # a new stream (the rows hold finite values: streaming_update's contract)


def package_path(args, config: tuple[int, int, int], directory: str) -> pathlib.Path:
    """The package file of a cache configuration ``(sink, chunk, window frames)``: its name hashes everything baked
    in (the weights are constants: freezing): the arguments that shape the model and the pass, the configuration,
    threads, the CPU's vector ISA, torch, the Inductor settings, kvops' lowering tag and the examples' source
    (``_common.package_path``)."""
    key = {name: getattr(args, name) for name in ("device", "dtype", "layers", "tokens_per_frame", "ffn", "impl")}
    return _package_path(directory, "streaming_video", {**key, "config": list(config)}, __file__)


class PackagedStep(AOTPackage):
    """``--package DIR``: a configuration's compiled pass as an AOTInductor package of ``StreamStep``, called by
    ``stream()`` as the model, on ``TensorCursorCache`` layers.

    On the first call the step is exported (static shapes: every pass of a stream has the chunk's shape), compiled
    with the same Inductor settings as the torch.compile path (``aoti_compile_and_package``) and saved as
    ``package_path`` in DIR; a later process finds the file and only loads it, after checking its bytes against the
    sha256 recorded beside it at build time (``check_package``: a changed or corrupted package is refused, naming
    the file and the cure): the warm start torch.compile's caches do not give a frozen graph in torch 2.13
    (docs/compile.md). Each call stores the returned cursors in place, so
    ``reset`` (which zeros them) starts a new stream."""

    def __init__(self, model: StreamingModel, args, config: tuple[int, int, int], directory: str):
        update = aten_streaming_update if args.impl == "aten" else streaming_update
        self.step = StreamStep(model, config[0] * args.tokens_per_frame, update)
        super().__init__(package_path(args, config, directory))

    def __call__(self, x: torch.Tensor, caches: list[TensorCursorCache], start: int) -> torch.Tensor:
        cursors = caches[0].cursors
        tensors = (x, [c.k for c in caches], [c.v for c in caches], cursors, torch.tensor(start, device=x.device))
        signature = input_signature([("x", x), *((f"caches[{i}].{kv}", getattr(c, kv)) for i, c in enumerate(caches)
                                                 for kv in "kv"), ("cursors", cursors)])
        out = self.run(tensors, signature, export=lambda: torch.export.export(self.step, tensors))
        cursors.copy_(out[1])
        return out[0]


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


def main() -> None:
    p = parser(__doc__)
    add_device_options(p)
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (30 in Wan-2.1 1.3B)")
    p.add_argument("--tokens-per-frame", type=int, default=8, help="latent tokens per frame (1560 at 480x832)")
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
    add_run_options(p, "stream", "each configuration's pass (StreamStep)",
                    "dense roll-layout caches only; --kv-cache-quant runs stay eager")
    args = parse_run_args(p)
    if args.impl == "aten" and (args.layout != "roll" or args.kv_cache_quant != ["off"]):
        raise SystemExit("--impl aten is the dense roll-layout baseline: use it without --layout ring and "
                         "--kv-cache-quant")
    if args.package and args.layout != "roll":
        raise SystemExit("--package exports the dense roll-layout pass (kvops.export.streaming_update): use it "
                         "without --layout ring (with --impl kvops or --impl aten)")
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
    compiled = None if args.package else torch.compile(model, fullgraph=True)
    # K and V as views of one allocation (fused_kv) are aliased mutated graph inputs, which Inductor's freezing
    # mishandles in torch 2.13 (configure_cpu_inference_compile): separate K and V buffers when freezing.
    fused_kv = not torch._inductor.config.freezing and not args.package
    # compiled matmuls/RMSNorm may round differently from eager; the cache data movement itself is bit-exact (tests)
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
    ok, results = True, {}
    for name, (sink_f, chunk_f, window_f) in CONFIGS.items():
        chunk_tokens = chunk_f * tpf
        latents = torch.randn(1, args.chunks * chunk_tokens, HEADS * HEAD_DIM, device=device, dtype=dtype)

        def fresh_caches(cls=RingCausalKVCache if args.layout == "ring" else CausalKVCache, packaged=False):
            if packaged:  # separate zeroed K and V per layer, one cursors tensor for the stream
                cursors = init_cursors(device)
                return [TensorCursorCache(*(torch.zeros(1, window_f * tpf, HEADS, HEAD_DIM, dtype=dtype, device=device)
                                            for _ in "kv"), cursors) for _ in range(args.layers)]
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
            compiled_caches = fresh_caches(packaged=bool(args.package))
            if args.package:
                compiled = PackagedStep(model, args, (sink_f, chunk_f, window_f), args.package)
                print("  AOTInductor package: build or load (first compiled stream)...", flush=True)
            else:
                print("  compiling (first compiled stream: every graph compiles in its first chunks)...", flush=True)
            t0, c0 = time.perf_counter(), cpu_seconds()
            compiled_out, first_times = stream(compiled, compiled_caches, latents, chunk_tokens, args.steps, sync)
            first_stream, first_cpu = time.perf_counter() - t0, cpu_seconds() - c0
            graphs_first = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            status = compiled.status if args.package else None
            print(f"  first compiled stream {first_stream:.1f} s ({first_cpu:.1f} s CPU; first chunk "
                  f"{first_times[0]:.1f} s), " + (f"package {status}" if status else f"{graphs_first} graphs"),
                  flush=True)
            print(f"  timed streams: {args.repeats} x (eager, compiled) on reset caches, interleaved...", flush=True)
            warm = slice(args.chunks // 2, None)  # after the window filled up and eviction started
            eager_ms, compiled_ms, ratios = [], [], []
            for r in range(args.repeats):
                pair = {}
                order = [("eager", model, eager_caches), ("compiled", compiled, compiled_caches)]
                for label, fn, caches in order if r % 2 == 0 else order[::-1]:
                    for cache in caches:  # a stream on the same (reset) caches reuses the compiled graphs
                        cache.reset()
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
        if status:
            print(f"  compilations: none by torch.compile (an AOTInductor package, {status.split()[0]}; {graphs} "
                  f"graphs); second stream on reset caches equals the first: max diff {diff2:.1e}")
        else:
            print(f"  compilations: {graphs_first} graphs in the first stream of {args.chunks} chunks x "
                  f"{args.steps + 1} passes; {graphs} after a second stream on reset caches "
                  f"(second stream equals the first: max diff {diff2:.1e})")
        print(f"  per-chunk latency (median over chunks {warm.start + 1}-{args.chunks} of a stream), median [min-max] "
              f"of "
              f"{args.repeats} interleaved streams: eager {spread(eager_ms)} ms, compiled {spread(compiled_ms)} ms; "
              f"eager/compiled per pair {spread(ratios, '{:.2f}')}x; first compiled stream incl. "
              f"{'package ' + {'built': 'build', 'loaded': 'load'}[status.split()[0]] if status else 'compilation'} "
              f"{first_stream:.1f} s")
        results[name] = {"graphs_first": graphs_first, "graphs": graphs, "first_stream_s": first_stream,
                         "first_stream_cpu_s": first_cpu, "first_chunk_s": first_times[0], "eager_ms": eager_ms,
                         "compiled_ms": compiled_ms, "ratios": ratios, "max_diff": diff, "within_tolerance": within,
                         "package": status}
        print(f"  resident cache: {cache_bytes / 2**20:.2f} MiB for {args.layers} layers "
              f"({cache_bytes // args.layers} bytes/layer: K and V [1, {window_f * tpf}, {HEADS}, {HEAD_DIM}] {dtype}"
              f"{', one allocation' if fused_kv else ''})")
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

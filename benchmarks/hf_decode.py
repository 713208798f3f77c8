"""transformers decode step with kvops vs transformers' own path (StaticCache + sdpa), eager and compiled.

A tiny random Llama or Qwen2 (built from a config, no download). Per context length C (a batch of 1 holding C
tokens), one decode step is timed for four candidates, interleaved round by round (medians and spread of thread CPU
time, ``time.thread_time``, so other processes on a shared machine do not count):

- ``eager_kvops``:   ``attn_implementation="kvops"`` + ``KvopsStaticCache``, eager
- ``eager_sdpa``:    ``attn_implementation="sdpa"`` + transformers' ``StaticCache``, eager
- ``compiled_kvops``: the same kvops step under ``torch.compile(fullgraph=True)`` (Inductor)
- ``compiled_sdpa``: sdpa + ``StaticCache`` compiled the same way

Each step decodes at position C (the cursor is reset to C before every call, so the cache never fills).
Ratios are kvops / baseline measured in the same run. ``measure(...)`` returns the rows for benchmarks/e2e.py.

    python benchmarks/hf_decode.py                      # contexts 128 and 1024, 1 and 2 threads
    python benchmarks/hf_decode.py --contexts 128 --threads 1 --no-compile
    python benchmarks/hf_decode.py --processes 8 --threads 1   # one process's ratio varies with its memory layout
"""

from __future__ import annotations

import argparse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=["llama", "qwen2", "smollm2"], default="llama",
                        help="tiny config: llama (8/2 heads x 32), qwen2 (14/2 x 16) or smollm2 (SmolLM2-135M's "
                             "attention: 9/3 heads x 64, hidden 576, MLP 1536; --layers of its 30)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024], help="tokens held when decoding")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="intra-op thread counts to run")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds per candidate")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model and cache dtype")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny model")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile candidates")
    parser.add_argument("--processes", type=int, default=1,
                        help="repeat the measurement in N fresh processes; each row then reports the median over the "
                             "processes and the spread of the ratio (one process's ratio depends on its memory "
                             "layout: 0.93-1.06 at context 1024 in 8 processes of one machine)")
    parser.add_argument("--quick", action="store_true", help="context 128, 1 thread, 10 rounds, 1 process")
    parser.add_argument("--rows-json", action="store_true", help=argparse.SUPPRESS)  # a child of --processes
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error(f"--processes {args.processes}: needs at least 1 process")
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: needs at least 2 rounds (the p10-p90 spread)")
    if min(args.contexts) < 1:
        parser.error(f"--contexts {' '.join(map(str, args.contexts))}: a decode step needs at least 1 cached token")
    if min(args.threads) < 1:
        parser.error(f"--threads {' '.join(map(str, args.threads))}: needs at least 1 thread")
    if args.quick:
        args.contexts, args.threads, args.rounds, args.processes = [128], [1], 10, 1
    return args


def _model(family: str, layers: int, max_len: int, dtype):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=512, num_hidden_layers=layers, max_position_embeddings=max_len + 8,
                  intermediate_size=512)
    if family == "smollm2":  # the geometry of issue 22's real model (random weights, fewer layers)
        common.update(intermediate_size=1536, vocab_size=2048)
        config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, **common)
    elif family == "llama":
        config = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, **common)
    else:
        config = Qwen2Config(hidden_size=224, num_attention_heads=14, num_key_value_heads=2, **common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def _candidates(model, context: int, compile_: bool):
    """name -> zero-argument callable running one decode step at position ``context``."""
    import torch
    from transformers import StaticCache

    import kvops.integrations.transformers as kvops_hf

    ids = torch.randint(3, model.config.vocab_size, (1, 1))
    position = torch.tensor([[context]])
    out = {}
    for impl in ("kvops", "sdpa"):
        cache = (kvops_hf.KvopsStaticCache(model.config, max_cache_len=context + 1) if impl == "kvops"
                 else StaticCache(config=model.config, max_cache_len=context + 1))
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        cache.early_initialization(1, model.config.num_key_value_heads, head_dim, model.dtype, model.device)
        mask = torch.ones(1, context + 1, dtype=torch.long)

        def step(model=model, cache=cache, impl=impl, mask=mask):
            for layer in cache.layers:
                layer.cumulative_length.fill_(context)
            model.config._attn_implementation = impl
            return model(input_ids=ids, attention_mask=mask, position_ids=position, past_key_values=cache).logits

        out[f"eager_{impl}"] = step
        if compile_:
            compiled = torch.compile(model, fullgraph=True)

            def cstep(model=compiled, cache=cache, impl=impl, mask=mask):
                for layer in cache.layers:
                    layer.cumulative_length.fill_(context)
                model.config._attn_implementation = impl
                return model(input_ids=ids, attention_mask=mask, position_ids=position, past_key_values=cache).logits

            out[f"compiled_{impl}"] = cstep
    return out


def measure(family: str = "llama", contexts=(128, 1024), threads=(1, 2), rounds: int = 30, dtype: str = "float32",
            layers: int = 4, compile_: bool = True) -> list[dict]:
    """Rows ``{"family", "dtype", "threads", "context", "candidate", "median_ms", "p10_ms", "p90_ms",
    "ratio_vs_sdpa"}`` (thread CPU ms per decode step; ratio: kvops / sdpa of the same mode, else 1.0)."""
    import statistics
    import time

    import torch

    rows = []
    torch_dtype = getattr(torch, dtype)
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for context in contexts:
            model = _model(family, layers, context, torch_dtype)
            cands = _candidates(model, context, compile_)
            times = {name: [] for name in cands}
            with torch.no_grad():
                for fn in cands.values():  # warm-up (compiles)
                    fn(), fn()
                for _ in range(rounds):
                    for name, fn in cands.items():
                        t0 = time.thread_time()
                        fn()
                        times[name].append((time.thread_time() - t0) * 1e3)
            med = {name: statistics.median(t) for name, t in times.items()}
            for name, t in times.items():
                q = statistics.quantiles(t, n=10)
                base = name.replace("kvops", "sdpa")
                rows.append(dict(family=family, dtype=dtype, threads=n_threads, context=context, candidate=name,
                                 median_ms=med[name], p10_ms=q[0], p90_ms=q[-1],
                                 ratio_vs_sdpa=med[name] / med[base] if base != name else 1.0))
    return rows


def over_processes(argv: list[str], n: int) -> list[dict]:
    """The rows of ``n`` fresh processes running ``argv``, combined: medians over the processes of each row's median,
    p10, p90 and ratio, with the ratios' ``[min, max]`` as ``ratio_min``/``ratio_max``."""
    import json
    import statistics
    import subprocess
    import sys

    runs = []
    for _ in range(n):
        p = subprocess.run([sys.executable, __file__, *argv, "--processes", "1", "--rows-json"], capture_output=True,
                           text=True)
        if p.returncode:
            raise SystemExit(f"hf_decode.py: a measuring process failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    rows = []
    for same in zip(*runs):
        row = dict(same[0])
        for key in ("median_ms", "p10_ms", "p90_ms", "ratio_vs_sdpa"):
            row[key] = statistics.median(r[key] for r in same)
        row["ratio_min"], row["ratio_max"] = (f(r["ratio_vs_sdpa"] for r in same) for f in (min, max))
        rows.append(row)
    return rows


def main(argv=None):
    import json
    import sys

    args = parse_args(argv)
    if args.processes > 1:
        rows = over_processes(list(sys.argv[1:] if argv is None else argv), args.processes)
    else:
        rows = measure(args.family, args.contexts, args.threads, args.rounds, args.dtype, args.layers,
                       not args.no_compile)
    if args.rows_json:
        print(json.dumps(rows))
        return
    across = f" (median of {args.processes} processes; ratio spread over them)" if args.processes > 1 else ""
    print(f"{args.family} {args.dtype}, {args.layers} layers, thread CPU time per decode step{across}")
    print(f"{'threads':>7} {'context':>7} {'candidate':>15} {'median ms':>10} {'p10-p90 ms':>14} {'kvops/sdpa':>10}")
    for r in rows:
        ratio = f"{r['ratio_vs_sdpa']:.3f}" if "kvops" in r["candidate"] else ""
        if ratio and "ratio_min" in r:
            ratio += f" [{r['ratio_min']:.3f}-{r['ratio_max']:.3f}]"
        print(f"{r['threads']:>7} {r['context']:>7} {r['candidate']:>15} {r['median_ms']:>10.3f} "
              f"{r['p10_ms']:>6.3f}-{r['p90_ms']:<7.3f} {ratio:>10}")


if __name__ == "__main__":
    main()

"""transformers decode step with kvops vs transformers' own path (StaticCache + sdpa), eager and compiled.

A tiny random Llama or Qwen2 (built from a config, no download). Per context length C (a batch of 1 holding C
tokens), one decode step is timed for four candidates, interleaved round by round (benchmarks/_harness.py, as every
benchmark: rotated order, samples of >= ~2 ms, median [p25-p75] over the rounds; thread CPU time,
``time.thread_time``, at 1 thread, so other processes on a shared machine do not count; wall time at more):

- ``eager_kvops``:   ``attn_implementation="kvops"`` + ``KvopsStaticCache``, eager
- ``eager_sdpa``:    ``attn_implementation="sdpa"`` + transformers' ``StaticCache``, eager
- ``compiled_kvops``: the same kvops step under ``torch.compile(fullgraph=True)`` (Inductor)
- ``compiled_sdpa``: sdpa + ``StaticCache`` compiled the same way

Each step decodes at position C (the cursor is reset to C before every call, so the cache never fills).
Ratios are kvops / sdpa of the same mode per round (measured in the same run). ``measure(...)`` returns the rows;
benchmarks/e2e.py runs this script with ``--json``. No targets: the verdict block says what the run found.

    python benchmarks/hf_decode.py                      # contexts 128 and 1024, 1 and 2 threads
    python benchmarks/hf_decode.py --contexts 128 --threads 1 --no-compile
    python benchmarks/hf_decode.py --processes 8 --threads 1   # one process's ratio varies with its memory layout
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402  (no torch: --help answers at once)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=["llama", "qwen2", "smollm2"], default="llama",
                        help="tiny config: llama (8/2 heads x 32), qwen2 (14/2 x 16) or smollm2 (SmolLM2-135M's "
                             "attention: 9/3 heads x 64, hidden 576, MLP 1536; --layers of its 30)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024], help="tokens held when decoding")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="intra-op thread counts to run")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds per candidate (>= 2)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model and cache dtype")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny model")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile candidates")
    parser.add_argument("--processes", type=int, default=1,
                        help="repeat the measurement in N fresh processes; each row then reports the median over the "
                             "processes of each process's median, and the ratio's spread over the processes (one "
                             "process's ratio depends on its memory layout: 0.93-1.06 at context 1024 in 8 processes "
                             "of one machine)")
    parser.add_argument("--quick", action="store_true", help="context 128, 1 thread, 10 rounds, 1 process")
    parser.add_argument("--rows-json", action="store_true", help=argparse.SUPPRESS)  # a child of --processes
    harness.add_json_arg(parser)
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error(f"--processes {args.processes}: needs at least 1 process")
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: needs at least 2 rounds (the p25-p75 spread)")
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
    if family == "smollm2":  # SmolLM2-135M's geometry (docs/models.md) (random weights, fewer layers)
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
    """Rows ``{"family", "dtype", "threads", "context", "candidate", "ms": {"median", "p25", "p75", "rounds"},
    "ratio_vs_sdpa": {...} or None}`` (CPU ms per decode step; ratio: kvops / sdpa of the same mode, per round)."""
    import torch

    rows = []
    torch_dtype = getattr(torch, dtype)
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for context in contexts:
            model = _model(family, layers, context, torch_dtype)
            cands = _candidates(model, context, compile_)
            with torch.no_grad():
                t = harness.interleave(cands, rounds, clock=harness.pick_clock(n_threads)[0], warmup=2)
            for name in cands:
                base = name.replace("kvops", "sdpa")
                rows.append(dict(family=family, dtype=dtype, threads=n_threads, context=context, candidate=name,
                                 ms=t.time(name, 1e3).json(),
                                 ratio_vs_sdpa=t.ratio(name, base).json() if base != name else None))
    return rows


def over_processes(argv: list[str], n: int) -> list[dict]:
    """The rows of ``n`` fresh processes running ``argv``, combined: per row, the median over the processes of each
    process's median time, and the spread (median [p25-p75]) of the processes' median ratios."""
    import json
    import subprocess

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
        row["ms"] = harness.Spread.of(r["ms"]["median"] for r in same).json()
        if row["ratio_vs_sdpa"] is not None:
            row["ratio_vs_sdpa"] = harness.Spread.of(r["ratio_vs_sdpa"]["median"] for r in same).json()
        rows.append(row)
    return rows


def main(argv=None):
    import json

    args = parse_args(argv)
    if args.rows_json:
        print(json.dumps(measure(args.family, args.contexts, args.threads, args.rounds, args.dtype, args.layers,
                                 not args.no_compile)))
        return
    report = harness.Report("hf_decode", args, argv)
    report.start(threads=args.threads)
    if args.processes > 1:
        rows = over_processes(_without_json(sys.argv[1:] if argv is None else argv), args.processes)
    else:
        rows = measure(args.family, args.contexts, args.threads, args.rounds, args.dtype, args.layers,
                       not args.no_compile)
    across = (f"; per row: median over {args.processes} processes, the ratio's spread over the processes"
              if args.processes > 1 else "")
    report.note(f"{args.family} {args.dtype}, {args.layers} layers, CPU time per decode step, median [p25-p75] of "
                f"{args.rounds} interleaved rounds{across}; kvops/sdpa: per-round ratio to sdpa of the same mode")
    table = report.table("transformers decode step: kvops vs sdpa + StaticCache",
                         [("threads", 7, "{:d}"), ("context", 7, "{:d}"), ("candidate", 15), ("ms", 26, "{:.3f}"),
                          ("kvops/sdpa", 17)])
    spread = lambda d: d and harness.Spread(d["median"], d["p25"], d["p75"], d["rounds"])  # noqa: E731
    for r in rows:
        ratio = spread(r["ratio_vs_sdpa"])
        table.row(r["threads"], r["context"], r["candidate"], spread(r["ms"]), ratio,
                  family=r["family"], dtype=r["dtype"])
        if ratio is not None:
            report.finding(f"{r['candidate']} at context {r['context']}, {r['threads']} thread(s): {ratio}x "
                           "the time of sdpa + StaticCache")
    report.finish()


def _without_json(argv: list[str]) -> list[str]:
    """``argv`` without ``--json [PATH]`` (the measuring children print their rows instead)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--json":
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        elif not a.startswith("--json="):
            out.append(a)
    return out


if __name__ == "__main__":
    main()

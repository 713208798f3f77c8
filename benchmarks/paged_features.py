"""Cost of the attention features in kvops.paged_attention: each feature's decode time over the same call without it.

Candidates, on the same paged cache (block_size 16, randomly permuted block table, K/V and q ~ N(0, 1)), each a
decode batch (B sequences, one query each, over a context of C tokens): **none** (no feature), **alibi**
(``alibi_slopes [H_q]``), **rope** (RoPE at read time, ``rope_theta=1e4``), **leftpad** (``cache_leftpad`` all 0:
the same keys as none), **window** (``window_left = C / 2``: half the keys) and **sink+window** (4 sink tokens and
the same window), plus the **ideal** (SDPA over a contiguous cache, as in benchmarks/paged_decode.py). Value checks
are off while timing (the kernels alone).

Timing (benchmarks/_harness.py, as every benchmark): 1 CPU thread by default, clock = the thread's CPU time
(``time.thread_time``: time the process is preempted by other jobs is not counted); candidates run interleaved (order
rotated every round), each sample a batch of calls lasting >= ~20 ms; the table gives each candidate's median time
and its ratio over none (median [p25-p75] of the per-round ratios). Only ratios are meaningful; nothing is asserted.
Targets (``TARGETS``): alibi, rope and leftpad within 1.15x of none; window and sink+window at most 0.7x (they read
half the keys); the verdict block at the end says which hold on this host.

    python benchmarks/paged_features.py [--rounds 7] [--threads 1] [--geometries qwen2.5-0.5b llama-3.1-8b] [--quick]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402  (no torch: --help answers at once)

GEOMETRIES = {"qwen2.5-0.5b": (14, 2, 64), "llama-3.1-8b": (32, 8, 128)}  # (H_q, H_kv, D), as paged_decode.py


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES),
                        help="attention geometries (query heads / KV heads x head_dim of these models)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"),
                        help="cache and query dtypes")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="decode batch sizes")
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024], help="context lengths in tokens")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per row")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: thread CPU time; more: wall time)")
    parser.add_argument("--quick", action="store_true",
                        help="qwen2.5-0.5b, float32, B=1, context 256, 3 rounds (options given explicitly still "
                             "apply to what they name)")
    harness.add_json_arg(parser)
    args = parser.parse_args(argv)
    if args.quick:
        given = set(argv if argv is not None else sys.argv[1:])
        for flag, key, value in (("--geometries", "geometries", ["qwen2.5-0.5b"]), ("--dtypes", "dtypes", ["float32"]),
                                 ("--batches", "batches", [1]), ("--contexts", "contexts", [256]),
                                 ("--rounds", "rounds", 3)):
            if flag not in given:
                setattr(args, key, value)
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kvops  # noqa: E402


def candidates(geometry, dtype, batch, context):
    h_q, h_kv, d = GEOMETRIES[geometry]
    dt = getattr(torch, dtype)
    bs, blocks = 16, -(-context // 16)
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(batch * blocks, bs, h_kv, d, generator=g).to(dt)
    v_cache = torch.randn(batch * blocks, bs, h_kv, d, generator=g).to(dt)
    table = torch.randperm(batch * blocks, generator=g).view(batch, blocks).to(torch.int32)
    q = torch.randn(batch, h_q, d, generator=g).to(dt)
    lens = torch.full((batch,), context, dtype=torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    features = {
        "none": {}, "alibi": dict(alibi_slopes=torch.rand(h_q, generator=g) * 0.1), "rope": dict(rope_theta=1e4),
        "leftpad": dict(cache_leftpad=torch.zeros(batch, dtype=torch.int32)),
        "window": dict(window_left=context // 2), "sink+window": dict(window_left=context // 2, sink_tokens=4),
    }
    out = {name: (lambda kw=kw: kvops.paged_attention(q, k_cache, v_cache, cu, lens, table, 1, **kw))
           for name, kw in features.items()}
    kd = torch.randn(batch, h_kv, context, d, generator=g).to(dt)
    vd = torch.randn(batch, h_kv, context, d, generator=g).to(dt)
    qd = q.view(batch, h_kv, h_q // h_kv, d)
    out["ideal"] = lambda: F.scaled_dot_product_attention(qd, kd, vd)
    return out


TARGETS = {  # feature: (op, bound on the median of feature / none)
    "alibi": ("<=", 1.15), "rope": ("<=", 1.15), "leftpad": ("<=", 1.15), "window": ("<=", 0.7),
    "sink+window": ("<=", 0.7),
}
MEANING = {
    "<=1.15": "on this host, decode with {feature} takes {value:.2f}x the time of the same call without it "
              "({over:.0%} past the target): a model using that feature pays that much more per attention call",
    "<=0.7": "on this host, decode with {feature} (half the keys visible) takes {value:.2f}x the full call's time "
             "({over:.0%} past the target): the window saves less time than the keys it skips",
}


def main(args) -> None:
    torch.set_num_threads(args.threads)
    clock = harness.pick_clock(args.threads)[0]
    kvops.set_value_checks("off")
    report = harness.Report("paged_features", args)
    report.start(threads=args.threads)
    report.note(f"{clock} clock, {args.rounds} interleaved rounds; value checks off; us: median time per call; "
                "/none: per-round ratio to the same call without features; ideal: SDPA over a contiguous cache")
    for geometry in args.geometries:
        h_q, h_kv, d = GEOMETRIES[geometry]
        for dtype in args.dtypes:
            table = report.table(f"{geometry} ({h_q}/{h_kv} heads x {d}), {dtype}",
                                 [("case", 13), ("feature", 11), ("us", 8, "{:.0f}"), ("/none", 17), ("target", 8)])
            for batch in args.batches:
                for context in args.contexts:
                    fns = candidates(geometry, dtype, batch, context)
                    t = harness.interleave(fns, args.rounds, clock=clock, min_sample_s=0.02)
                    case = f"B={batch} ctx={context}"
                    for name in fns:
                        r = t.ratio(name, "none")
                        op, bound = TARGETS.get(name, (None, None))
                        target = "-" if op is None else f"{op}{bound:g} {'ok' if r.median <= bound else 'MISS'}"
                        table.row(case, name, t.time(name, 1e6).median, r if name != "none" else None, target)
                        if op is not None:
                            report.target(f"{name} / none {op} {bound:g}", f"{geometry} {dtype} {case}, {name}", r,
                                          bound, op, MEANING[f"{op}{bound:g}"].replace("{feature}", name))
    report.finish()


if __name__ == "__main__":
    main(ARGS)
    sys.exit(0)

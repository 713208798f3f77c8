"""Paged attention: kvops.paged_attention against the unpaged ideal, gather-then-SDPA and FlexAttention, side by side.

Candidates, all on the same K/V values (synthetic: K/V, q ~ N(0, 1)):

* **ideal**: ``scaled_dot_product_attention`` over a contiguous ``[B, H_kv, S, D]`` cache, each KV head's query heads
  folded into query rows (``q.view(B, H_kv, G, D)``): K/V read once, no block table, no ``repeat_interleave``. It is
  the attention with the paging taken away, the bar a paged kernel is measured against. It is not a lower bound:
  kvops' kernel is a different kernel, specialised for decode (it splits long contexts across threads, reads
  bf16/fp16 K/V with vectorized conversion and software prefetch), so it can be faster than torch's general SDPA
  kernel, and a ratio below 1 means exactly that.
* **kvops eager / compiled**: ``kvops.paged_attention`` over a paged cache (block_size 16, randomly permuted block
  table), eagerly and under ``torch.compile(fullgraph=True, dynamic=True)``.
* **gather**: gather-then-SDPA, what a model without a paged kernel does: ``k_cache[block_table]`` into a contiguous
  copy, then the ideal's SDPA (eager).
* **flex**: FlexAttention with torch's ``PagedAttention`` (``torch.nn.attention.experimental``), compiled
  (``torch.compile(flex_attention)``), page size 128 (FlexAttention's KV block), decode rows only. Its compile takes
  one to two minutes per shape on a 2-core CPU, so ``--quick`` leaves it out unless ``--peers`` names it.

Workloads: decode (every sequence decodes one token over ``context`` cached tokens, B in {1, 8, 32} x context in
{256, 1024, 4096}) for Qwen2.5-0.5B (14/2 heads x 64, GQA 7:1) and Llama-3.1-8B (32/8 x 128, GQA 4:1); chunked
prefill, 4 sequences x (512 cached + 128 new tokens) with the bottom-right causal mask; bfloat16 and float32.

Timing (benchmarks/_harness.py, shared by every benchmark): candidates run interleaved (the order rotated every
round), after a warm-up, each sample a batch of calls lasting >= ~2 ms; a ratio is taken per round, and a cell prints
its median [p25-p75] over the rounds, so load from other processes hits both sides of a ratio; '~' marks a figure
whose spread is wider than 20% of its median: rerun it on an idle machine before believing it. With one thread the
clock is the thread's CPU time (``time.thread_time``: time the process is preempted by other jobs is not counted);
with more threads, and on CUDA, wall time (CUDA: synchronized). GB/s are the K/V bytes a call must read over its
median time. Only ratios are meaningful; nothing is asserted. At B = 1 a second line gives eager kvops with the
default value checks over the ideal, and compiled kvops over the compiled ideal (both pay torch.compile's per-call
graph entry, printed above each table).

Targets (the ``TARGETS`` table below): kvops decode <= 1.2x the ideal at B in {8, 32} x context in {1024, 4096},
<= 2x at B = 1 x context 256; prefill <= 1.3x. The target column gives, per kvops mode (eager/compiled), whether its
median meets the row's target; the verdict block at the end says which targets hold on this host, the largest miss
and what it means. ``--json`` writes every row and target for tools. With matplotlib installed
(``pip install -e '.[bench]'``) a PNG of the ratios against context is written next to the table.

    python benchmarks/paged_decode.py [--quick] [--threads 1 2] [--peers gather flex] [--device cuda] [--out DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402  (no torch: --help answers at once)

GEOMETRIES = {"qwen2.5-0.5b": (14, 2, 64), "llama-3.1-8b": (32, 8, 128)}  # (H_q, H_kv, D), docs/models.md
QUICK = dict(batches=[1, 8], contexts=[256, 1024], rounds=5, threads=[1], peers=["gather"])
FULL = dict(batches=[1, 8, 32], contexts=[256, 1024, 4096], rounds=9, threads=[1, 2], peers=["gather", "flex"])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--quick", action="store_true",
                        help="a smaller run: B in {1, 8} x context in {256, 1024}, 5 rounds, 1 thread, peers: gather "
                             "(options given explicitly still apply); its table goes to paged_decode_quick.txt")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the tensors live (cuda: kvops' Triton kernels, wall clock)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"),
                        help="cache and query dtypes")
    parser.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES),
                        help="attention geometries (query heads / KV heads x head_dim of these models)")
    parser.add_argument("--threads", nargs="+", type=int, help="torch CPU thread counts, one table each "
                        f"(default {FULL['threads']}, --quick {QUICK['threads']})")
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=("eager", "compiled"),
                        help="how kvops.paged_attention is called")
    parser.add_argument("--peers", nargs="*", choices=("gather", "flex"),
                        help=f"other candidates besides the ideal (default {FULL['peers']}, --quick {QUICK['peers']})")
    parser.add_argument("--batches", nargs="+", type=int,
                        help=f"decode batch sizes (default {FULL['batches']}, --quick {QUICK['batches']})")
    parser.add_argument("--contexts", nargs="+", type=int,
                        help=f"decode context lengths in tokens (default {FULL['contexts']}, --quick {QUICK['contexts']})")
    parser.add_argument("--rounds", type=int,
                        help=f"interleaved rounds per row (default {FULL['rounds']}, --quick {QUICK['rounds']})")
    parser.add_argument("--no-prefill", action="store_true", help="skip the chunked-prefill row")
    parser.add_argument("--value-checks", default="off", choices=("eager", "async", "off"),
                        help="kvops.set_value_checks mode while timing (default off: the kernels alone; B = 1 rows "
                             "also time the default eager mode)")
    parser.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                        help="auto: thread CPU time at 1 CPU thread, wall time otherwise")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"),
                        help="folder for the table (paged_decode.txt, or paged_decode_quick.txt with --quick) and "
                             "the plot (.png, with matplotlib)")
    harness.add_json_arg(parser)
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device == "cuda":
        args.threads = args.threads[:1]  # CPU threads do not matter to CUDA kernels
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kvops  # noqa: E402

from plots import save_ratio_plot  # noqa: E402

BLOCK_SIZE = 16
FLEX_PAGE = 128
# The targets, one entry each (change or add targets here only): the rows a target applies to (kind "decode" or
# "prefill"; batches, contexts: None = every one), the kvops modes held to it, the baseline candidate, and the bound
# on the median of the per-round ratio kvops / baseline.
TARGETS = {
    "decode B in {8, 32} x ctx in {1024, 4096}: kvops <= 1.2x ideal":
        dict(kind="decode", batches=(8, 32), contexts=(1024, 4096), modes=("eager", "compiled"), baseline="ideal",
             bound=1.2),
    "decode B=1 ctx=256: kvops <= 2.0x ideal":
        dict(kind="decode", batches=(1,), contexts=(256,), modes=("eager", "compiled"), baseline="ideal", bound=2.0),
    "chunked prefill: kvops <= 1.3x ideal":
        dict(kind="prefill", batches=None, contexts=None, modes=("eager", "compiled"), baseline="ideal", bound=1.3),
}
MEANING = {  # what a miss means for a user, per kind of row ({baseline}: BASELINES' words for the target's baseline)
    "decode": "on this host, decode attention over kvops' paged cache takes {value:.2f}x the time of {baseline} "
              "({over:.0%} past the target): the attention part of every decode step costs that much more; the whole "
              "step slows by less, in proportion to attention's share of it (small at short contexts)",
    "prefill": "on this host, chunked-prefill attention over kvops' paged cache takes {value:.2f}x the time of "
               "{baseline} ({over:.0%} past the target): prompt processing (time to the first token) pays that on its "
               "attention",
}
BASELINES = {"ideal": "SDPA over the same K/V stored contiguously", "gather": "gathering the blocks and calling SDPA",
             "flex": "compiled FlexAttention with torch's PagedAttention"}
sync = lambda: None  # noqa: E731  (torch.cuda.synchronize on CUDA)


def targets_for(kind: str, batch: int, context: int) -> dict:
    """The TARGETS entries that apply to a row."""
    return {name: t for name, t in TARGETS.items() if t["kind"] == kind
            and (t["batches"] is None or batch in t["batches"]) and (t["contexts"] is None or context in t["contexts"])}


def interleaved(cands: dict, rounds: int, clock: str) -> harness.Timings:
    """Every candidate's per-call seconds per round (benchmarks/_harness.py: warm-up, ~2 ms samples, rotated order)."""
    return harness.interleave(cands, rounds, clock=clock, sync=sync, max_reps=200)


def copy_bandwidth_gbs(device, clock: str, nbytes: int = 256 << 20) -> float:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = interleaved({"copy": lambda: dst.copy_(src)}, 5, clock).time("copy").median
    return 2 * nbytes / t / 1e9


def make_case(geometry, batch: int, q_len: int, context: int, dtype, device, flex: bool, seed: int = 0):
    """Paged, dense (and FlexAttention-paged) copies of the same K/V; ``context`` includes the ``q_len`` new tokens."""
    h_q, h_kv, d = GEOMETRIES[geometry]
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 8
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, h_kv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, h_kv, d, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: batch * blocks_per_seq].view(batch, -1).to(torch.int32)
    q = torch.randn(batch * q_len, h_q, d, generator=g).to(dtype)
    dense = lambda c: c[table.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()  # noqa: E731
    group = h_q // h_kv
    # folded queries [B, H_kv, q_len * G, D], rows (query, group head)
    q_f = q.view(batch, q_len, h_kv, group, d).permute(0, 2, 1, 3, 4).reshape(batch, h_kv, q_len * group, d)
    mask = None
    if q_len > 1:  # bottom-right causal: query i sits at position context - q_len + i
        pos = context - q_len + torch.arange(q_len).repeat_interleave(group)
        mask = torch.arange(context)[None, :] <= pos[:, None]
    c = dict(q=q, q_f=q_f.contiguous(), mask=mask, k_cache=k_cache, v_cache=v_cache, block_table=table,
             seq_lens=torch.full((batch,), context, dtype=torch.int32),
             cu_seqlens_q=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32), max_seqlen_q=q_len)
    c["k_dense"], c["v_dense"] = dense(k_cache), dense(v_cache)
    c = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in c.items()}
    c.update(batch=batch, q_len=q_len, context=context, group=group)
    if flex:
        c.update(make_flex(c, h_q, device))
    return c


def make_flex(c, h_q, device):
    """FlexAttention's paged cache ``[1, H_kv, n_pages * 128, D]`` holding the same K/V, and its block mask."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask

    batch, context = c["batch"], c["context"]
    n_pages = batch * -(-context // FLEX_PAGE)
    paged = PagedAttention(n_pages, FLEX_PAGE, batch, device=device)
    for b in range(batch):
        paged.reserve(torch.tensor(b, device=device), torch.tensor(context, device=device))
    k_dense, v_dense = c["k_dense"], c["v_dense"]
    k_flex = k_dense.new_zeros(1, k_dense.shape[1], n_pages * FLEX_PAGE, k_dense.shape[3])
    v_flex = torch.zeros_like(k_flex)
    positions = torch.arange(context, device=device)[None].expand(batch, context)
    paged.assign(torch.arange(batch, device=device), positions, k_dense, v_dense, k_flex, v_flex)
    lens = c["seq_lens"].long()
    logical = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < lens[b], batch, None, 1, context,
                                device=device, BLOCK_SIZE=(FLEX_PAGE, FLEX_PAGE))
    q_flex = c["q"].view(batch, 1, h_q, -1).transpose(1, 2)  # [B, H_q, 1, D]
    return dict(k_flex=k_flex, v_flex=v_flex, q_flex=q_flex, flex_mask=paged.convert_logical_block_mask(logical))


def run_ideal(c):
    return F.scaled_dot_product_attention(c["q_f"], c["k_dense"], c["v_dense"], attn_mask=c["mask"])


def run_gather(c):
    t = c["block_table"].long()
    k = c["k_cache"][t].flatten(1, 2)[:, : c["context"]].transpose(1, 2)
    v = c["v_cache"][t].flatten(1, 2)[:, : c["context"]].transpose(1, 2)
    return F.scaled_dot_product_attention(c["q_f"], k, v, attn_mask=c["mask"])


def run_kvops(c):
    return kvops.paged_attention(c["q"], c["k_cache"], c["v_cache"], c["cu_seqlens_q"], c["seq_lens"],
                                 c["block_table"], c["max_seqlen_q"])


# one graph per (geometry, dtype, batch == 1) under dynamic shapes (sizes 0/1 specialize): above Dynamo's default 8
torch._dynamo.config.recompile_limit = 64
run_compiled = torch.compile(run_kvops, fullgraph=True, dynamic=True)
run_ideal_compiled = torch.compile(run_ideal, fullgraph=True, dynamic=True)
_flex_compiled = None


def run_flex(c):
    global _flex_compiled
    if _flex_compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _flex_compiled = torch.compile(flex_attention, fullgraph=True)
    return _flex_compiled(c["q_flex"], c["k_flex"], c["v_flex"], block_mask=c["flex_mask"], enable_gqa=True)


def run_checked(c):
    """Eager kvops in the default value-check mode ("eager": the index tensors' contents are checked per call)."""
    with kvops.value_checks("eager"):
        return run_kvops(c)


def graph_entry_us(device, clock: str, rounds: int = 5) -> float:
    """Per-call cost of entering a compiled graph (guards, wrappers): a compiled one-multiply over a decode's
    inputs minus the eager multiply, in microseconds. Every compiled B = 1 call pays it once."""
    c = make_case("qwen2.5-0.5b", 1, 1, 256, torch.float32, device, flex=False)
    mul = lambda c: c["q"] * 2  # noqa: E731
    cmul = torch.compile(mul, fullgraph=True, dynamic=True)
    t = interleaved({"eager": lambda: mul(c), "compiled": lambda: cmul(c)}, rounds, clock)
    return (t.time("compiled").median - t.time("eager").median) * 1e6


def unfold(c, out_f):
    """Ideal's ``[B, H_kv, q_len * G, D]`` back to kvops' packed ``[T, H_q, D]``."""
    b, h_kv, _, d = out_f.shape
    return out_f.view(b, h_kv, c["q_len"], c["group"], d).permute(0, 2, 1, 3, 4).reshape(-1, h_kv * c["group"], d)


def measure(c, cands_wanted, rounds, clock, extras=False):
    """Ratios (Spreads) of every candidate to the ideal, and the largest difference of any candidate's output from
    the ideal's. With ``extras`` (B = 1: per-call overheads matter) also compiled kvops vs the compiled ideal (both
    pay the graph entry) and eager kvops with the default value checks."""
    fns = {"eager": run_kvops, "compiled": run_compiled, "gather": lambda c: unfold(c, run_gather(c)),
           "flex": lambda c: run_flex(c).transpose(1, 2).flatten(0, 1)}  # [B, H_q, 1, D] -> [B, H_q, D]
    ref = unfold(c, run_ideal(c)).float()
    err = max((fns[n](c).float() - ref).abs().max().item() for n in cands_wanted)
    cands = {"ideal": lambda: run_ideal(c)}
    for n in cands_wanted:
        cands[n] = {"eager": lambda: run_kvops(c), "compiled": lambda: run_compiled(c),
                    "gather": lambda: run_gather(c), "flex": lambda: run_flex(c)}[n]
    if extras:
        cands["ideal_compiled"] = lambda: run_ideal_compiled(c)
        cands["checked"] = lambda: run_checked(c)
    t = interleaved(cands, rounds, clock)
    res = {"err": err, "ms": {n: t.time(n, 1e3).median for n in cands}}
    res.update({n: t.ratio(n, "ideal") for n in cands if n != "ideal"})
    if extras and "compiled" in cands:
        res["compiled_vs_compiled"] = t.ratio("compiled", "ideal_compiled")
    # kvops over each peer measured in the same rounds, for targets against a peer (TARGETS' baseline)
    res["vs"] = {(m, b): t.ratio(m, b) for m in ("eager", "compiled") if m in cands
                 for b in ("gather", "flex") if b in cands}
    kv_bytes = c["k_dense"].numel() * 2 * c["k_dense"].element_size()
    res["gbs"] = {n: kv_bytes / (ms * 1e-3) / 1e9 for n, ms in res["ms"].items()}
    return res


def ratio_to(r, mode: str, baseline: str):
    """kvops ``mode`` over ``baseline`` (the ideal, or a peer measured in the same rounds); None if not measured."""
    return r.get(mode) if baseline == "ideal" else r["vs"].get((mode, baseline))


def target_cell(r, row_targets: dict, modes) -> str:
    """Per target of the row: its bound (and baseline, if not the ideal) and, per kvops mode (eager/compiled), ok or
    MISS by the median ("-": the mode is not held to it, or its baseline was not measured)."""
    parts = []
    for t in row_targets.values():
        cells = []
        for m in modes:
            value = ratio_to(r, m, t["baseline"]) if m in t["modes"] else None
            cells.append("-" if value is None else "ok" if value.median <= t["bound"] else "MISS")
        parts.append(f"{t['bound']:g}{'' if t['baseline'] == 'ideal' else ' ' + t['baseline']}: {'/'.join(cells)}")
    return " ".join(parts) or "-"


def main(args) -> None:
    global sync
    device = torch.device(args.device)
    if device.type == "cuda":
        sync = torch.cuda.synchronize
    kvops.set_value_checks(args.value_checks)
    kernel = ("Triton" if device.type == "cuda" else
              "native C++" if kvops.native.available() else "composite torch (no native build)")
    peers = list(args.peers)
    report = harness.Report("paged_decode", args)
    report.start(threads=args.threads, device=args.device, kvops_kernel=kernel)
    report.note(f"block_size {BLOCK_SIZE}; value checks {args.value_checks}; {args.rounds} interleaved rounds per row"
                + (" (--quick)" if args.quick else ""))
    report.note("ideal = SDPA over the same K/V stored contiguously (query heads folded, K/V read once, no block "
                "table): the attention without paging. It is a bar, not a bound: kvops' decode kernel (context split "
                "across threads, vectorized bf16 loads, prefetch) can beat torch's general SDPA kernel, so ratios < 1 "
                "are possible.")
    report.note("cells: candidate time / ideal time per round, median [p25-p75]; eager, compiled = "
                "kvops.paged_attention eagerly and under torch.compile; gather = gather-then-SDPA; flex = compiled "
                "FlexAttention + PagedAttention (decode rows); GB/s: K/V bytes read per second by eager kvops (or "
                "the first mode); target: the row's bound on kvops/ideal and, per mode (eager/compiled), ok or MISS "
                "by the median (the verdict at the end names each target); prefill = 4 x (512 cached + 128 new).")
    panels = {}
    cand_cols = [*args.modes, *peers]
    col_names = {"eager": "eager/ideal", "compiled": "compiled/ideal", "gather": "gather/ideal", "flex": "flex/ideal"}
    max_err = 0.0
    for threads in args.threads:
        torch.set_num_threads(threads)
        clock_name = harness.pick_clock(threads, device.type, args.clock)[0]
        where = f"{threads} CPU thread(s)" if device.type == "cpu" else torch.cuda.get_device_name(device)
        report.print(f"\n=== {where}, {clock_name} clock ===")
        report.print(f"copy bandwidth (read + write) {copy_bandwidth_gbs(device, clock_name):.1f} GB/s; "
                     f"torch.compile graph entry {graph_entry_us(device, clock_name):.1f} us per call")
        for geometry in args.geometries:
            h_q, h_kv, d = GEOMETRIES[geometry]
            for dtype_name in args.dtypes:
                dtype = getattr(torch, dtype_name)
                table = report.table(
                    f"{geometry} ({h_q}/{h_kv} heads x {d}), {dtype_name}, {where}",
                    [("case", 13), ("ideal ms", 8, "{:.3f}"), *((col_names[n], 17) for n in cand_cols),
                     ("GB/s", 6, "{:.2f}"), ("target", 13)])
                shapes = [("decode", b, 1, s) for b in args.batches for s in args.contexts]
                if not args.no_prefill:
                    shapes.append(("prefill", 4, 128, 640))
                for kind, batch, q_len, context in shapes:
                    row_cands = [n for n in cand_cols if not (n == "flex" and kind == "prefill")]
                    c = make_case(geometry, batch, q_len, context, dtype, device, flex="flex" in row_cands)
                    r = measure(c, row_cands, args.rounds, clock_name, extras=batch == 1)
                    del c
                    max_err = max(max_err, r["err"])
                    case = f"B={batch} ctx={context}" if kind == "decode" else "prefill"
                    row_targets = targets_for(kind, batch, context)
                    kv = args.modes[0] if args.modes else None
                    table.row(case, r["ms"]["ideal"], *(r.get(n) for n in cand_cols),
                              r["gbs"][kv] if kv else None, target_cell(r, row_targets, args.modes),
                              geometry=geometry, dtype=dtype_name, threads=threads, kind=kind, batch=batch,
                              context=context, ms=r["ms"], gbs=r["gbs"], max_err=r["err"],
                              **{f"{m}/{b}": v for (m, b), v in r["vs"].items()})
                    if "checked" in r:
                        table.sub(f"B = 1: eager kvops with value checks (default mode) / ideal {r['checked']}"
                                  + (f"; compiled kvops / compiled ideal {r['compiled_vs_compiled']}"
                                     if "compiled_vs_compiled" in r else ""))
                    name = f"{geometry} {dtype_name} {case}" + (f", {threads} threads" if len(args.threads) > 1
                                                                 else "")
                    for target, t in row_targets.items():
                        for mode in t["modes"]:
                            value = ratio_to(r, mode, t["baseline"])
                            if value is not None:
                                report.target(target, f"{name}, {mode}", value, t["bound"], "<=",
                                              MEANING[kind].replace("{baseline}", BASELINES[t["baseline"]]))
                    if kind == "decode":
                        for mode in cand_cols:
                            panel = f"{geometry} {dtype_name} {mode}"
                            series = panels.setdefault(panel, {}).setdefault(f"B={batch}, {threads}T", [])
                            series.append((context, r[mode].median, r[mode].p25, r[mode].p75))
    report.print(f"\nlargest |candidate - ideal| over every row: {max_err:.1e} (outputs agree; only the times differ)")
    report.finish()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "paged_decode_quick" if args.quick else "paged_decode"
    (out / f"{stem}.txt").write_text("\n".join(report.lines) + "\n")
    png = save_ratio_plot(out / f"{stem}.png", panels, "context (tokens)", "candidate / ideal",
                          targets={p: 1.2 for p in panels})
    report.print(f"\ntable: {out / (stem + '.txt')}" + (f"; plot: {png}" if png else " (no matplotlib: no plot)"))


if __name__ == "__main__":
    main(ARGS)

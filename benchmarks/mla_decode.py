"""MLA decode on CPU: ``kvops.mla_attention`` (absorbed form, paged latent cache) against the obvious composite and
against gather-then-SDPA over up-projected K/V, at DeepSeek-V3's attention geometry.

Geometry (DeepSeek-V3's public config): 128 query heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
v_head_dim 128, softmax scale 192 ** -0.5; a latent cache ``[P, block_size, 576]`` with block_size 64 (FlashMLA's),
each sequence's blocks at random places. A decode batch: B sequences of ``ctx`` tokens, one query each. Synthetic
random values (fp32 by default: bf16 matmuls are emulated on CPUs without AVX512-BF16).

Table 1, the op (same absorbed inputs ``q [B, 128, 576]``, same output ``[B, 128, 512]``): kvops' CPU kernel vs the
obvious composite (gather the table's blocks padded to the longest sequence, matmul, masked softmax, matmul).
Table 2, the attention step of the model (the same ``q_nope``/``q_pe`` in, ``[B, 128, 128]`` per-head outputs out):
absorbed kvops (``q_nope @ W_UK``, ``mla_attention``, ``@ W_UV``) vs gather-then-SDPA (gather each sequence's latent
rows, up-project ``kv_c @ W_kv_b`` to 128 heads of K ``[S, 192]`` and V ``[S, 128]``, SDPA). Candidates run interleaved
(benchmarks/_harness.py); ratios are per round; nothing is asserted; the verdict block says what held.

    python benchmarks/mla_decode.py [--rounds 10] [--threads 2] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _harness as harness  # noqa: E402  (no torch: --help answers at once)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds per case")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="q and cache dtype")
    parser.add_argument("--quick", action="store_true", help="one small case (B 2, ctx 256), at most 3 rounds")
    harness.add_json_arg(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help answers at once

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kvops  # noqa: E402

HEADS, RANK, ROPE, NOPE, V = 128, 512, 64, 128, 128
BLOCK_SIZE = 64
SCALE = (NOPE + ROPE) ** -0.5
CASES = ((1, 1024), (8, 512), (4, 2048))


def make_case(batch: int, ctx: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    kv_cache = (torch.randn(num_blocks, BLOCK_SIZE, RANK + ROPE, generator=g) * 0.5).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: batch * per_seq].to(torch.int32).view(batch, per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    seq_lens[0] = ctx - 7  # sequences of different lengths
    cu = torch.arange(batch + 1, dtype=torch.int32)
    q_nope = (torch.randn(batch, HEADS, NOPE, generator=g)).to(dtype)
    q_pe = (torch.randn(batch, HEADS, ROPE, generator=g)).to(dtype)
    w_kv_b = (torch.randn(HEADS, NOPE + V, RANK, generator=g) * RANK ** -0.5).to(dtype)
    return dict(kv_cache=kv_cache, table=table, seq_lens=seq_lens, cu=cu, q_nope=q_nope, q_pe=q_pe,
                w_uk=w_kv_b[:, :NOPE].contiguous(), w_uv=w_kv_b[:, NOPE:].contiguous(),
                w_kv_b=w_kv_b.reshape(HEADS * (NOPE + V), RANK))


def absorbed_q(c):
    return torch.cat((torch.einsum("bhn,hnr->bhr", c["q_nope"], c["w_uk"]), c["q_pe"]), dim=-1)


def kvops_op(c, q):
    return kvops.mla_attention(q, c["kv_cache"], c["cu"], c["seq_lens"], c["table"], 1, RANK, scale=SCALE)[0]


def composite_op(c, q):
    """Gather the blocks of every sequence (padded to the table's width), matmul, masked softmax, matmul."""
    kv = c["kv_cache"][c["table"].long()].flatten(1, 2).float()  # [B, S_max, 576]
    s = torch.matmul(q.float(), kv.transpose(1, 2)) * SCALE  # [B, H, S_max]
    hidden = torch.arange(kv.shape[1])[None, :] >= c["seq_lens"][:, None]
    p = torch.softmax(s.masked_fill(hidden[:, None, :], float("-inf")), dim=-1)
    return torch.matmul(p, kv[..., :RANK]).to(q.dtype)


def kvops_step(c):
    out = kvops_op(c, absorbed_q(c))
    return torch.einsum("bhr,hvr->bhv", out, c["w_uv"])


def sdpa_step(c):
    """Gather each sequence's latent rows, up-project to per-head K/V, SDPA (one query per sequence)."""
    outs = []
    table, lens = c["table"].long(), c["seq_lens"].tolist()
    for b, s in enumerate(lens):
        rows = c["kv_cache"][table[b]].flatten(0, 1)[:s]  # [S, 576]
        kv = (rows[:, :RANK] @ c["w_kv_b"].t()).view(s, HEADS, NOPE + V)
        k = torch.cat((kv[..., :NOPE], rows[:, None, RANK:].expand(s, HEADS, ROPE)), dim=-1).transpose(0, 1)
        v = kv[..., NOPE:].transpose(0, 1)
        q = torch.cat((c["q_nope"][b], c["q_pe"][b]), dim=-1)[:, None]  # [H, 1, 192]
        outs.append(F.scaled_dot_product_attention(q, k, v, scale=SCALE)[:, 0])
    return torch.stack(outs)


def main(args) -> None:
    torch.set_num_threads(args.threads)
    clock = harness.pick_clock(args.threads)[0]
    dtype = getattr(torch, args.dtype)
    report = harness.Report("mla_decode", args)
    report.start(threads=args.threads)
    rounds = min(args.rounds, 3) if args.quick else args.rounds
    cache_ratio = 2 * HEADS * 128 / (RANK + ROPE)
    report.note(f"{clock} clock, {rounds} interleaved rounds, {args.dtype}; DeepSeek-V3 geometry: {HEADS} heads, "
                f"kv_lora_rank {RANK}, rope {ROPE}, nope {NOPE}, v {V}, block_size {BLOCK_SIZE}. Latent cache per "
                f"token and layer: {RANK + ROPE} values vs 2 x {HEADS} x 128 = {2 * HEADS * 128} for MHA "
                f"({cache_ratio:.1f}x fewer; {HEADS * (NOPE + ROPE + V)} with K's 192 dims: "
                f"{HEADS * (NOPE + ROPE + V) / (RANK + ROPE):.1f}x)")
    op_table = report.table("the op: kvops.mla_attention vs the composite (gather blocks, matmul, softmax, matmul)",
                            [("B", 3, "{:d}"), ("ctx", 5, "{:d}"), ("kvops ms", 9, "{:.2f}"),
                             ("composite ms", 12, "{:.2f}"), ("kvops/composite", 22), ("max |diff|", 10, "{:.1e}")])
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    cases = [(batch, ctx, make_case(batch, ctx, dtype)) for batch, ctx in (((2, 256),) if args.quick else CASES)]
    for batch, ctx, c in cases:
        q = absorbed_q(c)
        diff = float((kvops_op(c, q).float() - composite_op(c, q).float()).abs().max())
        t = harness.interleave({"kvops": lambda: kvops_op(c, q), "composite": lambda: composite_op(c, q)}, rounds,
                               clock=clock)
        r = t.ratio("kvops", "composite")
        op_table.row(batch, ctx, t.time("kvops", 1e3).median, t.time("composite", 1e3).median, r, diff)
        report.target("op not slower than the composite: kvops/composite <= 1", f"B={batch} ctx={ctx}", r, 1.0,
                      meaning="the kernel is {over:.0%} slower than gathering and three torch ops")
    step_table = report.table("decode step: absorbed kvops vs gather-then-SDPA over up-projected K/V",
                              [("B", 3, "{:d}"), ("ctx", 5, "{:d}"), ("kvops ms", 9, "{:.2f}"),
                               ("SDPA ms", 9, "{:.2f}"), ("kvops/SDPA", 22), ("max |diff|", 10, "{:.1e}")])
    for batch, ctx, c in cases:
        step_diff = float((kvops_step(c).float() - sdpa_step(c).float()).abs().max())
        if step_diff > tol:
            report.finding(f"B={batch} ctx={ctx}: the two decode steps differ by {step_diff:.1e} (> {tol:g})")
        t = harness.interleave({"kvops": lambda: kvops_step(c), "sdpa": lambda: sdpa_step(c)}, rounds, clock=clock)
        r = t.ratio("kvops", "sdpa")
        step_table.row(batch, ctx, t.time("kvops", 1e3).median, t.time("sdpa", 1e3).median, r, step_diff)
        report.finding(f"B={batch} ctx={ctx}: absorbed kvops decode takes {r.median:.2f}x the time of "
                       f"gather-then-SDPA over up-projected K/V")
    report.finish()


if __name__ == "__main__":
    main(ARGS)

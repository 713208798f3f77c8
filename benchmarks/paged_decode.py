"""Paged decode attention on CPU: kvops.paged_attention vs. unpaged SDPA and vs. gather-then-SDPA.

For each (batch, context) every sequence decodes one token (``q_len = 1``) over ``context`` cached tokens with the
Qwen2.5-0.5B head geometry (14 query / 2 KV heads x 64, GQA 7:1), block_size 16 and a randomly permuted block table.
Three ways to compute the same attention, timed in the same run:

* ``sdpa``    -- ``F.scaled_dot_product_attention(enable_gqa=True)`` over a contiguous ``[B, H_kv, S, D]`` cache: the
                 unpaged ideal (no table indirection);
* ``gather``  -- gather the paged blocks into a contiguous tensor through ``block_table``, then the same SDPA call (the
                 usual fallback of frameworks without a paged kernel);
* ``kvops``   -- ``kvops.paged_attention`` on the paged cache.

Printed: median times, the ratios ``kvops / sdpa`` and ``kvops / gather`` (< 1 means kvops is faster), and the effective
bandwidth of the K/V bytes each method must read (``B * S * H_kv * (D + D_v) * itemsize / time``), next to the machine's
copy bandwidth measured at start. Only relative numbers are meaningful; nothing is asserted. On a machine shared
with other jobs, multi-threaded timings are dominated by scheduling (OpenMP threads waiting on each other); use
``--threads 1`` there.

    python benchmarks/paged_decode.py [--dtype float32|bfloat16] [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import kvops

H_Q, H_KV, HEAD_DIM, BLOCK_SIZE = 14, 2, 64, 16  # Qwen2.5-0.5B attention geometry (models.md)


def median_time(fn, min_reps: int = 5, budget_s: float = 0.4) -> float:
    """Median wall time of ``fn()`` in seconds over at least ``min_reps`` runs (after one warm-up)."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 256 << 20) -> float:
    """Read + write GB/s of a large ``copy_`` (the machine's practical memory bandwidth for this benchmark)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), min_reps=5, budget_s=0.5)
    return 2 * nbytes / t / 1e9


def make_case(batch: int, context: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 8
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, H_KV, HEAD_DIM, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, H_KV, HEAD_DIM, generator=g).to(dtype)
    block_table = torch.randperm(num_blocks, generator=g)[: batch * blocks_per_seq].view(batch, -1).to(torch.int32)
    q = torch.randn(batch, H_Q, HEAD_DIM, generator=g).to(dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32)
    # the equivalent contiguous cache [B, H_kv, S, D] for the unpaged ideal
    k_dense = k_cache[block_table.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v_dense = v_cache[block_table.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens,
                cu_seqlens_q=cu_seqlens_q, k_dense=k_dense, v_dense=v_dense, context=context)


def run_sdpa(c):
    return F.scaled_dot_product_attention(c["q"].unsqueeze(2), c["k_dense"], c["v_dense"], enable_gqa=True)


def run_gather(c):
    table = c["block_table"].long()
    k = c["k_cache"][table].flatten(1, 2)[:, : c["context"]].transpose(1, 2)
    v = c["v_cache"][table].flatten(1, 2)[:, : c["context"]].transpose(1, 2)
    return F.scaled_dot_product_attention(c["q"].unsqueeze(2), k, v, enable_gqa=True)


def run_kvops(c):
    return kvops.paged_attention(c["q"], c["k_cache"], c["v_cache"], c["cu_seqlens_q"], c["seq_lens"],
                                 c["block_table"], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quick", action="store_true", help="fewer configurations")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    batches = (1, 8) if args.quick else (1, 8, 32)
    contexts = (256, 2048) if args.quick else (256, 1024, 4096)

    bw = copy_bandwidth_gbs()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}; "
          f"heads {H_Q}/{H_KV} x {HEAD_DIM} (Qwen2.5-0.5B), block_size {BLOCK_SIZE}, q_len 1")
    print(f"measured copy bandwidth (read + write): {bw:.1f} GB/s")
    header = (f"{'batch':>5} {'context':>7} | {'sdpa ms':>8} {'gather ms':>9} {'kvops ms':>8} | "
              f"{'kvops/sdpa':>10} {'kvops/gather':>12} | {'sdpa GB/s':>9} {'gather GB/s':>11} {'kvops GB/s':>10}")
    print(header)
    print("-" * len(header))
    for batch in batches:
        for context in contexts:
            c = make_case(batch, context, dtype)
            ref = run_sdpa(c).squeeze(2).float()
            err = (run_kvops(c).float() - ref).abs().max().item()  # sanity: the three compute the same attention
            t_sdpa, t_gather, t_kvops = (median_time(lambda f=f: f(c)) for f in (run_sdpa, run_gather, run_kvops))
            kv_bytes = batch * context * H_KV * 2 * HEAD_DIM * c["k_cache"].element_size()
            gbs = [kv_bytes / t / 1e9 for t in (t_sdpa, t_gather, t_kvops)]
            print(f"{batch:>5} {context:>7} | {t_sdpa * 1e3:>8.3f} {t_gather * 1e3:>9.3f} {t_kvops * 1e3:>8.3f} | "
                  f"{t_kvops / t_sdpa:>10.2f} {t_kvops / t_gather:>12.2f} | {gbs[0]:>9.2f} {gbs[1]:>11.2f} "
                  f"{gbs[2]:>10.2f}   (max |kvops - sdpa| {err:.1e})")


if __name__ == "__main__":
    main()

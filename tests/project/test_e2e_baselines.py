"""The examples' ``--impl aten`` baselines (benchmarks/e2e.py's compile-cost reference) compute what kvops computes,
and benchmarks/e2e.py answers ``--help`` without importing torch.

Eager only (no compile): the baselines are plain torch, compared with the kvops ops over the same steps.
"""

import subprocess
import sys

import torch

from kvops.cache import CausalKVCache, PagedKVCache
from tests.example_loader import ROOT, load_example, load_module


llm = load_example("llm_serving")
video = load_example("streaming_video")


def test_llm_aten_baseline_matches_kvops_over_mixed_steps():
    """Chunked prefill + decode steps with padding: the aten layer (index_put_ + masked SDPA) gives kvops' outputs
    and cache contents (block 0 is the aten run's scratch block, so kvops' cache keeps it free as well)."""
    torch.manual_seed(0)
    kv_layer = llm.Layer("kvops").eval()
    aten_layer = llm.Layer("aten").eval()
    aten_layer.load_state_dict(kv_layer.state_dict())
    caches = {}
    for impl in ("kvops", "aten"):
        cache = PagedKVCache(12, 4, llm.H_KV, llm.HEAD_DIM, num_layers=1)
        cache.add_sequence("scratch")
        cache.extend("scratch", 4)
        caches[impl] = cache
    steps = [[("a", 5), ("b", 3)], [("a", 1), ("b", 1), ("c", 6)], [("a", 1), ("c", 1)], [("b", 1)]]
    for i, items in enumerate(steps):
        outs = {}
        x = torch.randn(12, llm.HIDDEN, generator=torch.Generator().manual_seed(i))
        for impl, layer in (("kvops", kv_layer), ("aten", aten_layer)):
            cache = caches[impl]
            for seq, _ in items:
                if seq not in cache.seq_ids:
                    cache.add_sequence(seq)
            step = cache.prepare(items, pad_tokens=12, pad_batch=len(items) + 2, max_blocks=4)
            meta = {"slot_mapping": step.slot_mapping, "cu_seqlens_q": step.cu_seqlens_q,
                    "seq_lens": step.seq_lens, "block_table": step.block_table, "max_seqlen_q": step.max_seqlen_q}
            with torch.no_grad():
                outs[impl] = layer(x, step.positions, cache.k_caches[0], cache.v_caches[0], meta)
            num_tokens = step.num_tokens
        torch.testing.assert_close(outs["aten"][:num_tokens], outs["kvops"][:num_tokens], atol=2e-5, rtol=1e-5)
        for a, b in ((caches["aten"].k_caches[0], caches["kvops"].k_caches[0]),
                     (caches["aten"].v_caches[0], caches["kvops"].v_caches[0])):
            torch.testing.assert_close(a[1:], b[1:], atol=0, rtol=0)  # block 0: the baseline's scratch


def test_streaming_aten_cache_matches_causal_kv_cache():
    """Append, rewrites and evictions (with and without a sink) of the aten baseline cache give CausalKVCache's
    visible rows, bit for bit."""
    for sink in (0, 4):
        kv_cache = CausalKVCache.allocate(1, 12, video.HEADS, video.HEAD_DIM, fused_kv=True, sink_tokens=sink)
        aten_cache = video.AtenCausalCache(1, 12, sink, torch.float32, "cpu")
        gen = torch.Generator().manual_seed(sink)
        for chunk in range(7):
            for _ in range(3):  # append, then two rewrites of the same chunk
                k = torch.randn(1, 4, video.HEADS, video.HEAD_DIM, generator=gen)
                v = torch.randn(1, 4, video.HEADS, video.HEAD_DIM, generator=gen)
                a = kv_cache.update_and_get_attention_kv(k, v, current_chunk_start=4 * chunk)
                b = aten_cache.update_and_get_attention_kv(k, v, current_chunk_start=4 * chunk)
                torch.testing.assert_close(b.k, a.k, atol=0, rtol=0)
                torch.testing.assert_close(b.v, a.v, atol=0, rtol=0)


def test_e2e_help_is_fast_and_documents_every_option():
    code = ("import sys; sys.argv = ['e2e.py', '--help']\n"
            "import runpy\n"
            "try:\n    runpy.run_path('benchmarks/e2e.py', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'e2e.py --help imported torch'\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    bench = load_module(ROOT / "benchmarks" / "e2e.py", "kvops_bench_e2e")
    parser_actions = bench.build_parser()._actions
    missing = [a.option_strings for a in parser_actions if not a.help]
    assert not missing, missing

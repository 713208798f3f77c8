"""The examples' compiled CPU settings (Inductor freezing + the CPP GEMM backend, examples/llm_serving.py's
``configure_cpu_inference_compile``) freeze the weights only: the paged KV caches stay graph inputs that every
compiled step writes and the next step reads. One small compile (~10 s of CPU)."""

import torch
import torch._inductor.config

from kvops.cache import PagedKVCache
from tests.example_loader import load_example


llm = load_example("llm_serving")


def test_llm_layer_frozen_compile_writes_and_reads_the_caches_it_is_given():
    """Two prefill steps of two sequences: the second step attends to the first step's K/V, so a compiled layer whose
    caches had been folded into constants would give other outputs and leave the caller's caches unwritten."""
    torch.manual_seed(0)
    layer = llm.Layer("kvops").eval()
    caches = {impl: PagedKVCache(8, 4, llm.H_KV, llm.HEAD_DIM, num_layers=1) for impl in ("eager", "compiled")}
    for cache in caches.values():
        cache.add_sequence("a")
        cache.add_sequence("b")
    settings = {"freezing": False, "max_autotune": False, "max_autotune_gemm_backends": "ATEN"}
    with torch._inductor.config.patch(settings), torch.no_grad():  # restores the settings the example changes
        assert "freezing" in llm.configure_cpu_inference_compile(torch.device("cpu"))
        compiled = torch.compile(layer, fullgraph=True)
        for i in range(2):
            x = torch.randn(8, llm.HIDDEN, generator=torch.Generator().manual_seed(i))
            outs = {}
            for impl, fn in (("eager", layer), ("compiled", compiled)):
                step = caches[impl].prepare([("a", 3), ("b", 3)], pad_tokens=8, pad_batch=3, max_blocks=4)
                meta = {"slot_mapping": step.slot_mapping, "cu_seqlens_q": step.cu_seqlens_q,
                        "seq_lens": step.seq_lens, "block_table": step.block_table, "max_seqlen_q": step.max_seqlen_q}
                k_cache, v_cache = caches[impl].k_caches[0], caches[impl].v_caches[0]
                outs[impl] = fn(x, step.positions, k_cache, v_cache, meta)[: step.num_tokens]
            torch.testing.assert_close(outs["compiled"], outs["eager"], atol=1e-4, rtol=1e-4)
            for a, b in ((caches["compiled"].k_caches[0], caches["eager"].k_caches[0]),
                         (caches["compiled"].v_caches[0], caches["eager"].v_caches[0])):
                assert a.abs().sum() > 0  # written by the compiled step
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert not torch._inductor.config.freezing

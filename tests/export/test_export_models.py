"""The two examples' steps in exportable form (shared by the ONNX and AOTI tests), and their export signature.

- LLM decode step: ``examples/llm_serving.py``'s ``Model`` (Qwen2.5-0.5B attention geometry, random weights, 1 layer,
  vocab 256) on a ``PagedKVCache``; the step returns the greedy tokens.
- Streaming chunk step: ``examples/streaming_video.py``'s ``StreamStep`` (what its ``--package`` exports; Wan-2.1 heads
  12 x 128, random weights): its blocks on ``kvops.export.streaming_update`` instead of ``CausalKVCache``, so the
  cursors are tensors and the visible window is an attention mask, and one program serves appends, rewrites and
  evicting appends.

Signature (torch 2.13): ``torch.export`` keeps each cache write as an in-place ``kvops`` node and the graph signature
lists no mutated inputs; after ``run_decompositions()`` each write is an ``auto_functionalized_v2`` node and the caches
appear as ``USER_INPUT_MUTATION`` outputs.
"""

from __future__ import annotations

import unittest

import torch

import kvops
from kvops.cache import CausalKVCache, PagedKVCache
from kvops.export import init_cursors, streaming_update
from tests.example_loader import load_example


llm = load_example("llm_serving")
video = load_example("streaming_video")


# --- LLM decode step --------------------------------------------------------------------------------------------
class DecodeStep(torch.nn.Module):
    """``llm.Model`` with the step metadata as tensors; returns ``(next_tokens, *k_caches, *v_caches)`` (the caches are
    also mutated in place; ONNX, which has no in-place inputs, returns them as its outputs)."""

    def __init__(self, model, max_seqlen_q: int = 1):
        super().__init__()
        self.model, self.max_seqlen_q = model, max_seqlen_q

    def forward(self, input_ids, positions, k_caches, v_caches, slot_mapping, cu_seqlens_q, seq_lens, block_table):
        meta = {"slot_mapping": slot_mapping, "cu_seqlens_q": cu_seqlens_q, "seq_lens": seq_lens,
                "block_table": block_table, "max_seqlen_q": self.max_seqlen_q}
        return (self.model(input_ids, positions, k_caches, v_caches, meta), *k_caches, *v_caches)


class LLMSession:
    """Two requests prefilled eagerly, then decode steps padded to fixed shapes (width 4, 4 blocks per row)."""

    WIDTH, MAX_BLOCKS, BLOCK_SIZE = 4, 4, 8

    def __init__(self, layers: int = 1, vocab: int = 256, seed: int = 0):
        torch.manual_seed(seed)
        self.model = llm.Model(layers, vocab).eval()
        self.cache = PagedKVCache(16, self.BLOCK_SIZE, llm.H_KV, llm.HEAD_DIM, num_layers=layers, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed + 1)
        self.tokens = {"a": torch.randint(0, vocab, (11,), generator=gen).tolist(),
                       "b": torch.randint(0, vocab, (5,), generator=gen).tolist()}
        with torch.no_grad():
            for rid, prompt in self.tokens.items():  # eager prefill, one request at a time
                self.cache.add_sequence(rid)
                step = self.cache.prepare({rid: len(prompt)})
                nxt = DecodeStep(self.model, step.max_seqlen_q)(
                    torch.tensor(prompt), torch.arange(len(prompt)), self.cache.k_caches, self.cache.v_caches,
                    step.slot_mapping, step.cu_seqlens_q, step.seq_lens, step.block_table)[0]
                prompt.append(int(nxt[0]))

    def decode_inputs(self):
        """The next decode step's inputs (advances the block manager; the caches are passed as they are)."""
        step = self.cache.prepare({"a": 1, "b": 1}, pad_tokens=self.WIDTH, pad_batch=self.WIDTH,
                                  max_blocks=self.MAX_BLOCKS)
        assert step.max_seqlen_q == 1
        ids = [self.tokens["a"][-1], self.tokens["b"][-1]] + [0] * (self.WIDTH - 2)
        pos = [len(self.tokens["a"]) - 1, len(self.tokens["b"]) - 1] + [0] * (self.WIDTH - 2)
        return (torch.tensor(ids), torch.tensor(pos), self.cache.k_caches, self.cache.v_caches, step.slot_mapping,
                step.cu_seqlens_q, step.seq_lens, step.block_table)

    def accept(self, next_tokens) -> None:
        self.tokens["a"].append(int(next_tokens[0]))
        self.tokens["b"].append(int(next_tokens[1]))


# --- streaming chunk step: the example's StreamStep ------------------------------------------------------------
class StreamSession:
    """A scaled-down stream: 2 layers, 4 tokens/frame, chunk 1 frame, sink 1 frame, cache 4 frames (so chunks 4 and 5
    evict), 2 denoising steps (append, rewrite) + a context pass per chunk. The eager reference is the example's
    ``StreamingModel`` on ``CausalKVCache`` (window = cache size, as in the example)."""

    LAYERS, TOKENS, SINK, CACHE, FFN = 2, 4, 4, 16, 64

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.model = video.StreamingModel(self.LAYERS, self.FFN).eval()
        self.step = video.StreamStep(self.model, self.SINK)
        dim = video.HEADS * video.HEAD_DIM
        self.latents = torch.randn(1, 6 * self.TOKENS, dim, generator=torch.Generator().manual_seed(seed + 1))

    def zero_caches(self):
        shape = (1, self.CACHE, video.HEADS, video.HEAD_DIM)
        return [torch.zeros(shape) for _ in range(self.LAYERS)], [torch.zeros(shape) for _ in range(self.LAYERS)]

    def reference_caches(self):
        k, v = self.zero_caches()
        return [CausalKVCache(a, b, sink_tokens=self.SINK) for a, b in zip(k, v)]

    def passes(self):
        """``(start, step_index)`` of every pass of the stream: 2 denoising steps + 1 context pass per chunk."""
        for s in range(0, self.latents.shape[1], self.TOKENS):
            for i in range(3):
                yield s, i

    def example_inputs(self):
        k, v = self.zero_caches()
        return (self.latents[:, : self.TOKENS].clone(), k, v, init_cursors(), torch.tensor(0))

    def run(self, fn, reference: bool = False, replay: bool = False):
        """Run the whole stream through ``fn`` (a StreamStep-like callable, or the reference model); return every
        pass's output and the final caches. ``replay``: after every pass, apply ``streaming_update`` eagerly to
        copies of the caches with the chunk K/V ``fn`` returned, and check ``fn``'s caches equal them bit for bit."""
        outs = []
        if reference:
            caches = self.reference_caches()
        else:
            k_caches, v_caches = self.zero_caches()
            cursors = init_cursors()
        x = None
        with torch.no_grad():
            for s, i in self.passes():
                if i == 0:
                    x = self.latents[:, s : s + self.TOKENS].clone()
                if reference:
                    y = self.model(x, caches, s)
                else:
                    before = [c.clone() for c in k_caches + v_caches] if replay else None
                    y, new_cursors, *rest = fn(x, k_caches, v_caches, cursors, torch.tensor(s))
                    if replay:
                        _replay(before, rest[2 * self.LAYERS :], cursors, s, self.SINK, k_caches + v_caches)
                    cursors = new_cursors
                outs.append(y)
                if i < 2:
                    x = x - 0.25 * y
        if reference:
            assert caches[0].global_end > self.CACHE, "the stream must evict"
            return outs, [c.k for c in caches], [c.v for c in caches]
        return outs, k_caches, v_caches


def _replay(before, chunk_kv, cursors, start, sink, after):
    layers = len(before) // 2
    for i in range(layers):
        k_cache, v_cache = before[i], before[layers + i]
        streaming_update(chunk_kv[i], chunk_kv[layers + i], k_cache, v_cache, cursors, torch.tensor(start),
                         sink_tokens=sink)
        assert torch.equal(k_cache, after[i]) and torch.equal(v_cache, after[layers + i]), "cache not bit-exact"


# --- the export signature ---------------------------------------------------------------------------------------
def _mutations(ep):
    from torch.export.graph_signature import OutputKind

    return sorted(s.target for s in ep.graph_signature.output_specs if s.kind == OutputKind.USER_INPUT_MUTATION)


def _targets(ep):
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


class TestExportSignature(unittest.TestCase):
    def test_decode_step_mutations_after_run_decompositions(self):
        session = LLMSession()
        args = session.decode_inputs()
        ep = torch.export.export(DecodeStep(session.model), args)
        self.assertEqual(_mutations(ep), [])  # torch 2.13: in-place node, no mutation in the signature yet
        self.assertIn(torch.ops.kvops.paged_cache_write.default, _targets(ep))
        decomposed = ep.run_decompositions()
        hop = torch.ops.higher_order.auto_functionalized_v2
        nodes = [n for n in decomposed.graph.nodes if n.target is hop]
        self.assertEqual([n.args[0] for n in nodes], [torch.ops.kvops.paged_cache_write.default])
        self.assertEqual(_mutations(decomposed), ["k_caches_0", "v_caches_0"])
        self.assertIn(torch.ops.kvops.paged_attention.default, _targets(decomposed))

    def test_stream_step_mutations_after_run_decompositions(self):
        session = StreamSession()
        ep = torch.export.export(session.step, session.example_inputs())
        self.assertEqual(_mutations(ep), [])
        decomposed = ep.run_decompositions()
        hop = torch.ops.higher_order.auto_functionalized_v2
        ops = [n.args[0] for n in decomposed.graph.nodes if n.target is hop]
        # per layer the eviction move and the chunk write, both paged writes on the cache read as B blocks of S rows
        # (tensor positions, kvops.export.streaming_update)
        self.assertEqual(ops, [torch.ops.kvops.paged_cache_write.default] * 4)
        self.assertEqual(_mutations(decomposed), ["k_caches_0", "k_caches_1", "v_caches_0", "v_caches_1"])

    def test_functionalize_keeps_the_signature_and_the_results(self):
        session = LLMSession()
        args = session.decode_inputs()
        ep = kvops.export.functionalize(torch.export.export(DecodeStep(session.model), args))
        self.assertNotIn(torch.ops.higher_order.auto_functionalized_v2, _targets(ep))
        self.assertIn(torch.ops.kvops.paged_cache_write_functional.default, _targets(ep))
        self.assertEqual(_mutations(ep), ["k_caches_0", "v_caches_0"])
        k_ref, v_ref = [c.clone() for c in args[2]], [c.clone() for c in args[3]]
        k_run, v_run = [c.clone() for c in args[2]], [c.clone() for c in args[3]]
        with torch.no_grad():
            expected = DecodeStep(session.model)(args[0], args[1], k_ref, v_ref, *args[4:])[0]
            got = ep.module()(args[0], args[1], k_run, v_run, *args[4:])[0]
        self.assertTrue(torch.equal(got, expected))
        self.assertTrue(torch.equal(k_run[0], k_ref[0]) and torch.equal(v_run[0], v_ref[0]))  # written back
        self.assertFalse(torch.equal(k_run[0], args[2][0]))

    def test_functionalize_rejects_fused_kv_views(self):
        class Write(torch.nn.Module):
            def forward(self, k, v, kv, slots):
                kvops.paged_cache_write(k, v, kv[:, :, 0], kv[:, :, 1], slots)
                return kv

        kv = torch.zeros(2, 4, 2, 1, 8)
        ep = torch.export.export(Write(), (torch.randn(2, 1, 8), torch.randn(2, 1, 8), kv, torch.tensor([0, 3])))
        with self.assertRaises(ValueError) as cm:
            kvops.export.functionalize(ep)
        self.assertIn("Pass k_cache and v_cache as separate tensors", str(cm.exception))


if __name__ == "__main__":
    unittest.main()

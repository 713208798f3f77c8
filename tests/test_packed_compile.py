"""PackedCausalKVCache and packed_attention under torch.compile(fullgraph=True): a bounded number of graphs per
stream (none per chunk after warm-up), results equal to eager; Inductor fuses the dequantize into attention."""

from __future__ import annotations

import math
import unittest

import torch
import torch._dynamo
import torch._dynamo.testing
from torch._inductor.utils import fresh_inductor_cache, run_and_get_code

from kvops.cache import PackedCausalKVCache
from kvops.packed import dequantize_kv, packed_attention, quantize_kv

B, H, D = 1, 2, 32


def forward(x, caches, s, recent=None):
    for i, cache in enumerate(caches):
        view = cache.update_and_get_attention_kv(x + i, x - i, s, recent_window_tokens=recent)
        x = x + view.k.amax(dim=1, keepdim=True) * 0.5 + view.v.amin(dim=1, keepdim=True)
    return x


def stream(fn, caches, chunks, n, steps=2, recent=None):
    g = torch.Generator().manual_seed(0)
    outs, frames = [], []
    for chunk in range(chunks):
        for _ in range(1 + steps):  # append, then rewrites
            outs.append(fn(torch.randn(B, n, H, D, generator=g), caches, chunk * n, recent))
        frames.append(getattr(fn, "counter", None) and fn.counter.frame_count)
    return outs, frames


class TestCompileCount(unittest.TestCase):
    def run_stream(self, size, n, chunks=7, recent=None, **kwargs):
        make = lambda: [  # noqa: E731
            PackedCausalKVCache.allocate(B, size, H, D, chunk_tokens=n, dtype=torch.float32, **kwargs) for _ in range(1)
        ]
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")  # functionalized mutations too
        torch._dynamo.reset()
        compiled = torch.compile(forward, fullgraph=True, backend=counter)
        compiled.counter = counter
        with torch._dynamo.config.patch(recompile_limit=64):
            got, frames = stream(compiled, make(), chunks, n, recent=recent)
        want, _ = stream(forward, make(), chunks, n, recent=recent)
        for a, b in zip(got, want):
            self.assertTrue(torch.equal(a, b))
        return frames

    def test_bounded_graphs_and_none_after_warm_up(self):
        """Until the window is full, each chunk adds an append graph and a rewrite graph (the window gains a
        segment); then the structure repeats. Bound: 2 * (ceil(S / N) + 1)."""
        for size, n, recent, kwargs in ((9, 3, None, dict(quant="int8", sink_tokens=2)),
                                        (6, 2, 1, dict(quant="int2", keep_recent_chunks=0, num_clusters=2,
                                                       sink_tokens=2, quantize_sink=True))):
            frames = self.run_stream(size, n, recent=recent, **kwargs)
            bound = 2 * (math.ceil(size / n) + 1)
            self.assertLessEqual(frames[-1], bound, (size, n, kwargs, frames))
            warm = math.ceil(size / n) + 2
            self.assertEqual(len(set(frames[warm:])), 1, frames)  # no graph per chunk after warm-up


class TestInductor(unittest.TestCase):
    def test_packed_attention_compiles_fullgraph(self):
        cache = PackedCausalKVCache.allocate(1, 8, 2, 64, chunk_tokens=4, quant="int4", keep_recent_chunks=0,
                                             dtype=torch.float32)
        g = torch.Generator().manual_seed(0)
        for i in range(3):  # the window: one packed chunk, then the current one (dense)
            x = torch.randn(1, 4, 2, 64, generator=g)
            view = cache.update(x, x * 0.5, 4 * i)
        q = torch.randn(1, 4, 4, 64, generator=g)
        fn = lambda q, k, v: packed_attention(q, k, v)  # noqa: E731
        torch._dynamo.reset()
        out = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, view.k, view.v)
        torch.testing.assert_close(out, fn(q, view.k, view.v), rtol=1e-6, atol=1e-6)

    def test_dequantize_fuses_into_its_consumer(self):
        """Inductor decomposes kvops::dequantize_kv: unpack, scale and the consumer's reduction are one loop."""
        x = torch.randn(1, 8, 2, 64)
        packed = quantize_kv(x, "int4", group_size=32)
        fn = lambda p: (dequantize_kv(p, torch.float32) * 2).sum(dim=1)  # noqa: E731
        torch._dynamo.reset()
        with fresh_inductor_cache():
            out, code = run_and_get_code(torch.compile(fn, fullgraph=True), packed)
        torch.testing.assert_close(out, fn(packed), rtol=1e-5, atol=1e-5)
        source = "\n".join(code)
        self.assertNotIn("torch.ops.kvops.dequantize_kv", source)  # no extern call: decomposed
        self.assertEqual(source.count("async_compile.cpp_pybinding("), 1, source)  # one fused kernel


if __name__ == "__main__":
    unittest.main()

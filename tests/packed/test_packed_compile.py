"""PackedCausalKVCache and packed_attention under torch.compile(fullgraph=True): a bounded number of graphs per
stream (none per chunk after warm-up), results equal to eager; Inductor fuses the dequantize into attention."""

from __future__ import annotations

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


def forward_segments(x, caches, s, recent=None):
    """The memory-saving path: ``update()`` (the storage + row_counts) attended by ``kvops::packed_attention``."""
    for i, cache in enumerate(caches):
        view = cache.update(x + i, x - i, s, recent_window_tokens=recent)
        x = x + packed_attention(x, view.k, view.v)
    return x


def stream(fn, caches, chunks, n, steps=2, recent=None, pin_at=None):
    g = torch.Generator().manual_seed(0)
    outs, frames = [], []
    for chunk in range(chunks):
        for _ in range(1 + steps):  # append, then rewrites
            outs.append(fn(torch.randn(B, n, H, D, generator=g), caches, chunk * n, recent))
        for cache in caches if chunk == pin_at else ():  # pinned between compiled calls, as LongLive's shot sink
            if cache.pinnable:
                cache.pin_current_chunk(n)
        frames.append(getattr(fn, "counter", None) and fn.counter.frame_count)
    return outs, frames


class TestCompileCount(unittest.TestCase):
    def run_stream(self, chunks_in_window, n=2, sink=0, recent=None, backend="aot_eager", pin_at=None, extra=2,
                   fn=forward, exact=True, **kwargs):
        """A stream of ``chunks_in_window + extra`` chunks (an append and a rewrite each; the pool wraps around)
        under Dynamo's default recompile limit; returns the graph count after each chunk."""
        size = sink + chunks_in_window * n
        make = lambda: [PackedCausalKVCache.allocate(B, size, H, D, chunk_tokens=n, sink_tokens=sink,  # noqa: E731
                                                     dtype=torch.float32, **kwargs)]
        counter = torch._dynamo.testing.CompileCounterWithBackend(backend)  # aot_eager: functionalized mutations
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend=counter)
        compiled.counter = counter
        got, frames = stream(compiled, make(), chunks_in_window + extra, n, steps=1, recent=recent, pin_at=pin_at)
        want, _ = stream(fn, make(), chunks_in_window + extra, n, steps=1, recent=recent, pin_at=pin_at)
        for a, b in zip(got, want):
            self.assertTrue(torch.equal(a, b)) if exact else torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        return frames

    def test_graph_count_does_not_grow_with_the_window(self):
        """Appends and rewrites run one graph and the window is gathered by tensor arithmetic on the cursors, so a
        stream compiles the same few graphs for 3, 6 or 10 chunks in the window (measured, torch 2.13: 3 without
        a sink, 5 with one: the first call, the first rewrite at position 0, the dynamic graph, then one each when
        the first chunk is quantized and when the first sink chunk would leave the ring), none per chunk after
        the first 4 chunks. (Before: 2 * (ceil(S / N) + 1), past the recompile limit for windows of > 3 chunks.)"""
        for chunks in (3, 6, 10):
            for sink, keep, quant in ((0, 0, "int8"), (2, 1, "int4")):
                frames = self.run_stream(chunks, sink=sink, quant=quant, keep_recent_chunks=keep)
                self.assertLessEqual(frames[-1], 3 if sink == 0 else 5, (chunks, sink, keep, frames))
                self.assertEqual(len(set(frames[3:])), 1, frames)  # no graph per chunk after warm-up

    def test_segments_graph_count_does_not_grow_with_the_window(self):
        """``update()`` + ``packed_attention``: the segment list is the whole storage (fixed per cache) and the
        visible rows a row_counts tensor from the cursors' tensor arithmetic, so a stream compiles what
        ``update_and_get_attention_kv`` does (measured, torch 2.13: 3 without a sink, 5 with one, for windows of 3,
        6 and 10 chunks; none per chunk after the first 4 chunks). (Before, when the segments followed the window's
        chunks, one more graph per chunk until the window was full: 5 / 8 / 12 graphs without a sink and 6 / 9 / 13
        with one for windows of 3 / 6 / 10 chunks, past the default recompile limit of 8 from 6 chunks on.)"""
        for chunks, sink, keep, quant in ((3, 2, 1, "int4"), (6, 2, 1, "int4"), (10, 2, 1, "int4"), (10, 0, 0, "int8")):
            frames = self.run_stream(chunks, sink=sink, quant=quant, keep_recent_chunks=keep, fn=forward_segments)
            self.assertLessEqual(frames[-1], 3 if sink == 0 else 5, (chunks, sink, keep, frames))
            self.assertEqual(len(set(frames[3:])), 1, frames)

    def test_segments_pinned_chunk_recent_window_packed_sink(self):
        """A pin, a recent window and a packed sink together: 7 graphs (measured; the same count as
        ``update_and_get_attention_kv`` for this stream), under the default limit of 8, then none per chunk."""
        frames = self.run_stream(3, sink=2, pin_at=2, recent=1, quant="int2", keep_recent_chunks=0, num_clusters=2,
                                 quantize_sink=True, pinnable=True, extra=5, fn=forward_segments)
        self.assertLessEqual(frames[-1], 7, frames)
        self.assertEqual(len(set(frames[-3:])), 1, frames)

    def test_segments_stream_with_inductor(self):
        """``update()`` + ``packed_attention`` under the default Inductor backend: 6 graphs for a stream over a
        6-chunk window with a sink (measured, as ``update_and_get_attention_kv``: Inductor adds one), results equal
        to eager, on whatever on-disk caches the run finds (a warm FX graph cache compiles the same graphs:
        tests/export/test_warm_cache.py)."""
        frames = self.run_stream(6, sink=2, quant="int4", keep_recent_chunks=1, backend="inductor", extra=3,
                                 fn=forward_segments, exact=False)
        self.assertLessEqual(frames[-1], 6, frames)
        self.assertEqual(len(set(frames[4:])), 1, frames)

    def test_recent_window_and_packed_sink(self):
        frames = self.run_stream(5, n=2, sink=2, recent=1, quant="int2", keep_recent_chunks=0, num_clusters=2,
                                 quantize_sink=True)
        self.assertLessEqual(frames[-1], 6, frames)
        self.assertEqual(len(set(frames[3:])), 1, frames)

    def test_pinned_chunk(self):
        """A pin adds the graphs of its own events (pinned, the next chunk, the pin settled next to the global
        sink): 6 in all (measured), then none per chunk; compiled == eager through eviction past the pin."""
        frames = self.run_stream(3, sink=2, pin_at=2, quant="int8", keep_recent_chunks=0, pinnable=True, extra=6)
        self.assertLessEqual(frames[-1], 6, frames)
        self.assertEqual(len(set(frames[-3:])), 1, frames)


def packed_state(cache):
    """Every tensor a cache holds (dense rows and packed pools), for bit-exact comparisons; without the pool's last
    slot, the scratch that only a compiled rewrite writes (and nothing reads)."""
    out = []
    for value in vars(cache).values():
        if value is cache.pool:
            out += [t.narrow(1, 0, t.shape[1] - t.shape[1] // cache._slots) for t in value.tensors()]
        else:
            out += value.tensors() if hasattr(value, "tensors") else [value] if isinstance(value, torch.Tensor) else []
    return out


class TestInductor(unittest.TestCase):
    def test_stream_matches_eager_bit_exact(self):
        """A compiled stream (default Inductor backend) writes every quantized chunk into its own pool slot: the
        packed codes, scales, dense rows and returned windows equal eager's. torch 2.13 regenerates a mutated
        ``pool[i]`` view with an offset of 0 (no Inductor lowering for aten.sym_storage_offset); the pool slots
        are slices instead (kvops/cache/_packed_pool.py)."""
        def make():
            return [PackedCausalKVCache.allocate(B, 9, H, D, chunk_tokens=2, quant="int8", keep_recent_chunks=0,
                                                 sink_tokens=1, dtype=torch.float32),
                    PackedCausalKVCache.allocate(B, 9, H, D, chunk_tokens=2, quant="int4", keep_recent_chunks=1,
                                                 sink_tokens=3, quantize_sink=True, dtype=torch.float32)]
        torch._dynamo.reset()
        compiled = torch.compile(forward, fullgraph=True)
        got_caches, want_caches = make(), make()
        with torch._dynamo.config.patch(recompile_limit=64):  # correctness here; the graph count is tested above
            got, _ = stream(compiled, got_caches, 8, 2, steps=1)
        want, _ = stream(forward, want_caches, 8, 2, steps=1)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for got_cache, want_cache in zip(got_caches, want_caches):
            for a, b in zip(packed_state(got_cache), packed_state(want_cache)):
                self.assertTrue(torch.equal(a, b))

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

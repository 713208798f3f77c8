"""``kvops.export.streaming_update`` under ``torch.compile(fullgraph=True)`` with its cursors and
``current_chunk_start`` as tensors: one graph for a whole stream (no recompile as positions advance, no graph break,
no ``capture_scalar_outputs``), no host read in the compiled code, bit-exact against the eager ``CausalKVCache``
(docs/semantics.md §1) over appends, denoising rewrites and evicting appends after sink tokens; the position checks
per value-check mode."""

from __future__ import annotations

import unittest

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

import kvops
from kvops.cache import CausalKVCache
from kvops.export import init_cursors, streaming_update
from kvops.export.streaming import device_message
from tests.contract import _Wrap


def passes(chunks: int, n: int, steps: int = 3):
    """``current_chunk_start`` of every pass: per chunk an append, then ``steps - 1`` rewrites (denoising steps)."""
    return [c * n for c in range(chunks) for _ in range(steps)]


class TestOneGraphForAStream(unittest.TestCase):
    def run_stream(self, layout: str, window=None, window_mode="sink", batch=2, size=13, heads=3, d=80, d_v=16,
                   n=3, sink=4, chunks=12):
        g = torch.Generator().manual_seed(0)
        ref = CausalKVCache(torch.zeros(batch, size, heads, d), torch.zeros(batch, size, heads, d_v),
                            sink_tokens=sink, attention_window_size=window, window_mode=window_mode)
        if layout == "joint":  # K and V as views of one [B, S, 2, H, D] allocation (strided caches)
            kv = torch.zeros(batch, size, 2, heads, d)
            k_cache, v_cache = kv[:, :, 0], kv[:, :, 1]
        else:
            k_cache, v_cache = torch.zeros(batch, size, heads, d), torch.zeros(batch, size, heads, d_v)

        def step(key, value, k_cache, v_cache, cursors, start):
            return streaming_update(key, value, k_cache, v_cache, cursors, start, sink_tokens=sink,
                                    attention_window_size=window, window_mode=window_mode)

        counter = CompileCounterWithBackend("inductor")
        torch._dynamo.reset()
        with torch._dynamo.config.patch(capture_scalar_outputs=False):  # the default, which used to break the graph
            compiled = torch.compile(step, fullgraph=True, backend=counter)
            cursors = init_cursors()
            for s in passes(chunks, n):
                key = torch.randn(batch, n, heads, d, generator=g)
                value = torch.randn(batch, n, heads, v_cache.shape[3], generator=g)
                view = ref.update_and_get_attention_kv(key, value, current_chunk_start=s)
                mask, cursors = compiled(key, value, k_cache, v_cache, cursors, torch.tensor(s))
                self.assertTrue(torch.equal(k_cache, ref.k) and torch.equal(v_cache, ref.v), s)
                self.assertEqual(cursors.tolist(), [ref.global_end, ref.local_end])
                self.assertTrue(torch.equal(k_cache[:, mask], view.k) and torch.equal(v_cache[:, mask], view.v), s)
        self.assertEqual(counter.frame_count, 1)  # one graph, never recompiled
        self.assertGreater(ref.global_end, size + 4 * n)  # the stream evicted, several times

    def test_sink_evictions_and_rewrites_head_dim_80(self):
        self.run_stream("separate")

    def test_joint_caches_with_a_window_smaller_than_the_cache(self):
        self.run_stream("joint", window=8, d=16, d_v=16, n=2, sink=3, chunks=12, heads=2)


class TestNoHostRead(unittest.TestCase):
    def test_inductor_code_reads_no_position_on_the_host(self):
        """Every kvops op is lowered (the position check to device-side asserts, the moves and writes to scatters):
        the generated code calls no kvops op, reads no scalar (``.item()``) and holds the three checks' messages."""
        k_cache, v_cache = torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8)
        key = torch.randn(1, 2, 2, 8)

        def step(key, k_cache, v_cache, cursors, start):
            return streaming_update(key, key, k_cache, v_cache, cursors, start, sink_tokens=2)

        torch._dynamo.reset()
        _, codes = run_and_get_code(torch.compile(step, fullgraph=True), key, k_cache, v_cache,
                                    torch.tensor([8, 8]), torch.tensor(8))
        code = "\n".join(codes)
        for absent in ("torch.ops.kvops", "extern_kernels.", "_local_scalar_dense", ".item()"):
            self.assertNotIn(absent, code)
        for i in range(3):
            self.assertIn(device_message(i), code)


class TestValueCheckModes(unittest.TestCase):
    """``"eager"`` (default): eager calls and exported programs raise with the values (test_export_streaming.py),
    compiled code asserts on the device; ``"async"``: ``torch._assert_async`` everywhere; ``"off"``: unchecked, but
    nothing is written outside the cache."""

    def setUp(self):
        self.k, self.v = torch.zeros(1, 6, 1, 2), torch.zeros(1, 6, 1, 2)
        self.chunk = torch.ones(1, 2, 1, 2)
        self.cursors = torch.tensor([8, 6])  # after chunks at 0, 2, 4, 6 with a sink of 2

    def step(self, *args):
        return streaming_update(*args, sink_tokens=2)

    def raises(self, fn, s, i):
        before = self.k.clone(), self.v.clone()
        with self.assertRaises(RuntimeError) as cm:
            fn(self.chunk, self.chunk, self.k, self.v, self.cursors, torch.tensor(s))
        self.assertEqual(str(cm.exception), device_message(i))
        self.assertTrue(torch.equal(self.k, before[0]) and torch.equal(self.v, before[1]))

    def test_async_eager_compiled_and_exported(self):
        with kvops.value_checks("async"):
            self.raises(self.step, 10, 1)  # a gap
            for backend in ("aot_eager", "inductor"):
                torch._dynamo.reset()
                compiled = torch.compile(self.step, fullgraph=True, backend=backend)
                self.raises(compiled, 2, 2)  # a rewrite of evicted tokens
            ep = torch.export.export(_Wrap(self.step), (self.chunk, self.chunk, self.k.clone(), self.v.clone(),
                                                        self.cursors, torch.tensor(0)))
        self.assertIn("_assert_async", str(ep.graph))
        self.assertNotIn("stream_positions", str(ep.graph))  # no host read: no values in the message
        self.raises(ep.module(), 10, 1)

    def test_off_is_unchecked_and_stays_inside_the_cache(self):
        kv = torch.zeros(1, 8, 1, 2)  # the cache is rows [1, 7) of a larger allocation
        self.k, self.v = kv[:, 1:7], torch.zeros(1, 6, 1, 2)
        with kvops.value_checks("off"):
            for fn in (self.step, torch.compile(self.step, fullgraph=True)):
                torch._dynamo.reset()
                kv.zero_()
                mask, cursors = fn(self.chunk, self.chunk, self.k, self.v, self.cursors, torch.tensor(1))
                self.assertEqual(cursors.tolist(), [8, 6])  # a rewrite of tokens [1, 3): rows -1 and 0
                self.assertEqual(self.k[0, :, 0, 0].tolist(), [1, 0, 0, 0, 0, 0])  # row -1 skipped, row 0 written
                self.assertEqual(kv[0, [0, 7]].abs().sum().item(), 0)  # nothing outside the cache


if __name__ == "__main__":
    unittest.main()

"""CausalKVCache under torch.compile(fullgraph=True): a bounded number of graphs, results bit-equal to eager.

The streaming loop of block-causal video diffusion: every chunk is appended once, rewritten by 3 denoising steps and by
a clean context pass, over several layers, past the point of eviction. The caches are passed to the compiled function
as an argument (the pattern CausalKVCache's docstring recommends); a model holding them as module attributes
recompiles every step instead (checked below). The "model" uses exact ops only (add, mul by a power of two, amax/amin
over the visible rows), so Inductor's output can be compared bit for bit too.
"""

from __future__ import annotations

import unittest

import torch
import torch._dynamo
import torch._dynamo.testing
import torch._inductor.config
from torch._dynamo.utils import counters

from kvops import CausalKVCache

B, H, D = 1, 2, 4


def block(x: torch.Tensor, cache: CausalKVCache, s: int, layer: int, recent=None, head_start=None) -> torch.Tensor:
    """One layer: K/V from x, write them, mix the visible rows back into x (exact arithmetic)."""
    view = cache.update_and_get_attention_kv(x + layer, x - layer, s, head_start, recent)
    return x + view.k.amax(dim=1, keepdim=True) * 0.5 + view.v.amin(dim=1, keepdim=True)


def forward(x, caches, s, recent=None):
    for i, cache in enumerate(caches):
        x = block(x, cache, s, i, recent)
    return x


class Model(torch.nn.Module):
    """The recommended shape: the module holds weights; the caches come in as an argument of forward."""

    def __init__(self, layers: int):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((layers, D), 0.5), requires_grad=False)

    def forward(self, x, caches, s):
        for i, cache in enumerate(caches):
            x = block(x * self.scale[i], cache, s, i)
        return x


class ModelHoldingCaches(torch.nn.Module):
    """The pattern to avoid: caches as module attributes (Dynamo treats their int cursors as constants)."""

    def __init__(self, caches):
        super().__init__()
        self.caches = caches

    def forward(self, x, s):
        return forward(x, self.caches, s)


def make_caches(layers=2, size=6, heads=H, fused=False, **kwargs):
    out = []
    for _ in range(layers):
        if fused:
            kv = torch.full((B, size, 2, heads, D), -1.0)
            k, v = kv[:, :, 0], kv[:, :, 1]
        else:
            k, v = torch.full((B, size, heads, D), -1.0), torch.full((B, size, heads, D), -2.0)
        out.append(CausalKVCache(k, v, **kwargs))
    return out


def stream(fn, caches, chunks=6, n=2, steps=3, pin_after=(), recent=None, on_chunk=None):
    """Run the loop; returns every output. ``fn(x, caches, s[, recent])``."""
    g = torch.Generator().manual_seed(0)
    outs = []
    for chunk in range(chunks):
        s = chunk * n
        for _ in range(1 + steps + 1):  # append, denoising rewrites, clean context pass
            x = torch.randn(B, n, H, D, generator=g)
            outs.append(fn(x, caches, s) if recent is None else fn(x, caches, s, recent))
        if chunk in pin_after:
            for cache in caches:
                cache.pin_current_chunk(n)
        if on_chunk is not None:
            on_chunk(chunk)
    return outs


class CompileCase(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        counters.clear()

    def assert_same(self, eager_outs, compiled_outs, eager_caches, compiled_caches):
        self.assertEqual(len(eager_outs), len(compiled_outs))
        for a, b in zip(eager_outs, compiled_outs):
            self.assertTrue(torch.equal(a, b), "compiled output differs from eager")
        for a, b in zip(eager_caches, compiled_caches):
            self.assertTrue(torch.equal(a.k, b.k) and torch.equal(a.v, b.v), "compiled cache differs from eager")
            self.assertEqual((a.global_end, a.local_end, a.pinned_start), (b.global_end, b.local_end, b.pinned_start))

    def run_counted(self, max_graphs, warmup_chunks, chunks=6, fn=forward, **kwargs):
        """Compile ``fn`` with a counting backend, stream past eviction, compare with eager; returns graph count."""
        cache_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("pin_after", "recent", "n", "steps")}
        eager_caches = make_caches(**cache_kwargs)
        eager_outs = stream(fn, eager_caches, chunks, **kwargs)
        counter = torch._dynamo.testing.CompileCounter()
        compiled = torch.compile(fn, fullgraph=True, backend=counter)
        caches = make_caches(**cache_kwargs)
        per_chunk = []
        outs = stream(compiled, caches, chunks, on_chunk=lambda c: per_chunk.append(counter.frame_count), **kwargs)
        self.assert_same(eager_outs, outs, eager_caches, caches)
        self.assertLessEqual(counter.frame_count, max_graphs, per_chunk)
        self.assertEqual(per_chunk[warmup_chunks - 1], per_chunk[-1], f"recompiled after warm-up: {per_chunk}")
        self.assertEqual(counters["stats"]["unique_graphs"], counter.frame_count)
        return counter.frame_count


class TestGraphCount(CompileCase):
    # Chunks of 2 tokens in 6 rows: eviction starts at chunk 3 (the 4th); the loops run at least one chunk past it.
    def test_no_sink(self):
        # first call (all static), a rewrite with s == 0 (s still static), then one dynamic graph for everything.
        self.run_counted(max_graphs=3, warmup_chunks=2, chunks=5)

    def test_sink(self):
        self.run_counted(max_graphs=3, warmup_chunks=2, chunks=5, sink_tokens=2)

    def test_sink_window_smaller_than_cache(self):
        # +1 graph when the window first starts past the sink (the view becomes a cat of the sink and the newest
        # W - sink rows, docs/semantics.md §1.6).
        self.run_counted(max_graphs=4, warmup_chunks=4, layers=1, sink_tokens=1, attention_window_size=3, chunks=6)

    def test_sink_recent_window(self):
        self.run_counted(max_graphs=4, warmup_chunks=4, layers=1, sink_tokens=1, recent=1, chunks=6)

    def test_pinned_sink(self):
        # 3 + 3 graphs: the pin appears (unsettled: a 3-range cat), the eviction that settles it, the settled pin.
        self.run_counted(max_graphs=6, warmup_chunks=6, chunks=7, layers=1, size=8, sink_tokens=2,
                         global_sink_tokens=2, attention_window_size=6, pin_after=(2,))

    def test_windowed_pinned_sink(self):
        # W < S with a pin that falls behind the window (docs/semantics.md §1.6: sink + pin + newest rows, a
        # 3-range cat), then the eviction that settles the pin (sink + newest). 7 graphs: the first call, the first
        # rewrite, the pin appearing, the window starting past the pin, the settling eviction (2); none afterwards.
        self.run_counted(max_graphs=7, warmup_chunks=8, chunks=10, layers=1, size=12, sink_tokens=2,
                         global_sink_tokens=1, attention_window_size=5, pin_after=(1,))

    def test_head_sliced_writers_in_lockstep(self):
        def sliced(x, caches, s):
            for i, cache in enumerate(caches):
                halves = [block(x[:, :, h : h + 1], cache, s, i, head_start=h) for h in range(H)]
                x = torch.cat(halves, dim=2)
            return x

        # +1 graph: the slices' cursors are created by the first call, so Dynamo first sees their ints on the second.
        self.run_counted(max_graphs=4, warmup_chunks=2, fn=sliced, layers=1, sink_tokens=1, chunks=5)

    def test_growth(self):
        # Growths at chunks 1, 2 and 4 (2 -> 4 -> 8 -> 16 rows); the buffers' row dim becomes dynamic after one.
        self.run_counted(max_graphs=5, warmup_chunks=5, chunks=5, layers=1, size=2, allow_growth=True, steps=1)

    def test_reset_reuses_the_graphs(self):
        counter = torch._dynamo.testing.CompileCounter()
        compiled = torch.compile(forward, fullgraph=True, backend=counter)
        caches = make_caches(sink_tokens=1)
        first = stream(compiled, caches)
        graphs = counter.frame_count
        for cache in caches:
            cache.reset()
        second = stream(compiled, caches)
        self.assertEqual(counter.frame_count, graphs)
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(first, second)))

    def test_recommended_module_pattern(self):
        model = Model(layers=2)
        eager_caches, caches = make_caches(sink_tokens=1), make_caches(sink_tokens=1)
        eager_outs = stream(model, eager_caches)
        counter = torch._dynamo.testing.CompileCounter()
        outs = stream(torch.compile(model, fullgraph=True, backend=counter), caches)
        self.assert_same(eager_outs, outs, eager_caches, caches)
        self.assertLessEqual(counter.frame_count, 3)

    def test_module_holding_caches_recompiles_every_step(self):
        model = ModelHoldingCaches(make_caches(layers=1))
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with torch._dynamo.config.patch(recompile_limit=4):
            with self.assertRaises(torch._dynamo.exc.FailOnRecompileLimitHit):
                stream(lambda x, caches, s: compiled(x, s), model.caches, chunks=3, steps=0)


class TestBackends(CompileCase):
    def test_aot_eager_fused_kv(self):
        """K and V as views of one [B, S, 2, H, D] allocation: two aliased, mutated graph inputs per cache."""
        eager_caches, caches = make_caches(fused=True, sink_tokens=1), make_caches(fused=True, sink_tokens=1)
        eager_outs = stream(forward, eager_caches, chunks=4, steps=1)
        outs = stream(torch.compile(forward, fullgraph=True, backend="aot_eager"), caches, chunks=4, steps=1)
        self.assert_same(eager_outs, outs, eager_caches, caches)
        self.assertLessEqual(counters["stats"]["unique_graphs"], 3)

    def test_inductor(self):
        """The default backend (Inductor, with kvops' write lowerings), sink, past eviction.

        At most 4 graphs: Inductor may add one guard, ``roll count == 0`` (raised while computing the strides of the
        moved rows' copy in the roll lowering), so appends that evict get their own graph. Torch's default
        configuration, the on-disk FX graph cache included (warm or cold: tests/export/test_warm_cache.py).
        """
        eager_caches, caches = make_caches(layers=1, sink_tokens=1), make_caches(layers=1, sink_tokens=1)
        eager_outs = stream(forward, eager_caches, chunks=5, steps=1)
        per_chunk = []
        outs = stream(torch.compile(forward, fullgraph=True), caches, chunks=5, steps=1,
                      on_chunk=lambda c: per_chunk.append(counters["stats"]["unique_graphs"]))
        self.assert_same(eager_outs, outs, eager_caches, caches)
        self.assertLessEqual(per_chunk[-1], 4, per_chunk)
        self.assertEqual(per_chunk[3], per_chunk[-1], per_chunk)


if __name__ == "__main__":
    unittest.main()

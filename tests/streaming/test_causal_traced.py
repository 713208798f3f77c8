"""CausalKVCache built *inside* traced code: torch.compile(fullgraph=True) and torch.export (strict and
non-strict) construct the cache, stream chunks through it (append, rewrite, evicting append, growth) and return the
same K/V as eager; the fused-K/V detection gives the eager answer under every trace.

Before the fix, construction failed on ``untyped_storage().data_ptr()`` ("Dynamo does not know how to trace method
data_ptr of class UntypedStorage"; non-strict export: "Cannot access data pointer of Tensor").
"""

from __future__ import annotations

import unittest

import torch
import torch._dynamo

from kvops import CausalKVCache

B, S, H, D = 1, 5, 2, 3


def chunk(x: torch.Tensor, i: int) -> torch.Tensor:
    return x * (i + 1) + i  # distinct K/V per chunk, exact arithmetic


def stream_in(k: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Build a cache on the given buffers and run append, rewrite, append, evicting append; every view (cloned, see
    below), and whether the cache saw K/V as one allocation.

    The views are cloned because torch 2.13's AOTAutograd cannot return a view of a graph input that is itself a view
    of another input's base (K of a joint K/V allocation): "incorrect out shape after application of ViewMeta
    sequence", with the cache built outside the trace as well; a model consumes the view inside (attention).
    """
    cache = CausalKVCache(k, v, sink_tokens=1, attention_window_size=4)
    views = []
    for i, s in enumerate((0, 0, 2, 4, 6)):  # chunks of 2 tokens; 0 twice: a rewrite
        view = cache.update_and_get_attention_kv(chunk(x, i), -chunk(x, i), s)
        views += [view.k.clone(), view.v.clone()]
    return (*views, torch.tensor(float(cache._fused_kv)))


def grow_in(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Allocate a fused cache inside the trace and grow it twice (buffers reallocated in the graph)."""
    cache = CausalKVCache.allocate(B, 2, H, D, dtype=x.dtype, fused_kv=True, allow_growth=True, sink_tokens=1)
    views = []
    for i in range(3):
        view = cache.update_and_get_attention_kv(chunk(x, i), -chunk(x, i), 2 * i)
        views += [view.k.clone(), view.v.clone()]
    return (*views, torch.tensor(float(cache._fused_kv)), torch.tensor(float(cache.cache_size)))


class _Module(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def buffers(fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if fused:
        kv = torch.full((B, S, 2, H, D), -7.0)
        return kv[:, :, 0], kv[:, :, 1]
    return torch.full((B, S, H, D), -7.0), torch.full((B, S, H, D), -8.0)


class TestBuiltInsideTrace(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        self.x = torch.arange(B * 2 * H * D, dtype=torch.float32).view(B, 2, H, D)

    def runners(self, fn):
        """Each mode as a callable: eager, compile (aot_eager, fullgraph), export strict and non-strict."""
        yield "eager", fn
        yield "compile", torch.compile(fn, fullgraph=True, backend="aot_eager")
        for strict in (True, False):
            def exported(*args, strict=strict):
                return torch.export.export(_Module(fn), args, strict=strict).module()(*args)

            yield f"export(strict={strict})", exported

    def check_stream(self, fused: bool, extra_modes=()):
        k0, v0 = buffers(fused)
        want = stream_in(k0, v0, self.x)
        self.assertEqual(want[-1].item(), float(fused))
        modes = list(self.runners(stream_in)) + list(extra_modes)
        for mode, run in modes[1:]:
            with self.subTest(mode=mode):
                k, v = buffers(fused)
                got = run(k, v, self.x)
                self.assertEqual(len(got), len(want))
                for a, b in zip(got, want):
                    self.assertTrue(torch.equal(a, b), f"{mode}: {a} vs {b}")
                self.assertTrue(torch.equal(k, k0) and torch.equal(v, v0), f"{mode}: the caches differ from eager")

    def test_fused_buffers(self):
        self.check_stream(fused=True)

    def test_separate_buffers(self):
        self.check_stream(fused=False)

    def test_fused_buffers_inductor(self):
        """The default backend once (kvops' write lowerings), on the joint K/V allocation."""
        k0, v0 = buffers(True)
        want = stream_in(k0, v0, self.x)
        k, v = buffers(True)
        got = torch.compile(stream_in, fullgraph=True)(k, v, self.x)
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(got, want)))
        self.assertTrue(torch.equal(k, k0) and torch.equal(v, v0))

    def test_allocate_and_grow_inside(self):
        want = grow_in(self.x)
        self.assertEqual((want[-2].item(), want[-1].item()), (1.0, 8.0))  # fused; 2 -> 4 -> 8 rows
        for mode, run in list(self.runners(grow_in))[1:]:
            with self.subTest(mode=mode):
                got = run(self.x)
                for a, b in zip(got, want):
                    self.assertTrue(torch.equal(a, b), f"{mode}: {a} vs {b}")


if __name__ == "__main__":
    unittest.main()

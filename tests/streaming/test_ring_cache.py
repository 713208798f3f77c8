"""RingCausalKVCache (kvops/cache/ring.py, docs/ring-cache.md) against CausalKVCache, the roll layout it must match.

Both caches run the same derandomized schedules (appends, rewrites, evicting appends, sinks, head slices, W < S,
``recent_window_tokens``): same errors (type and message up to the class name), same indices, and the ring view holds
exactly the same (position -> K/V row) pairs as the roll view, bit-exact (compared through ``ordered()`` and
``positions``). Heads outside the written slices keep their sentinels; an evicting append writes exactly the chunk.
"""

from __future__ import annotations

import unittest
from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvops.cache.ring as ring_module
from kvops import CausalKVCache, RingCausalKVCache
from kvops.cache import RingKVView
from tests.streaming.test_causal_cache import sentinel_cache


def _clone_buffers(batch, size, heads, dim, fused):
    k, v = sentinel_cache(batch, size, heads, dim, fused)
    if fused:
        kv = k.new_empty(batch, size, 2, heads, dim)
        kv[:, :, 0], kv[:, :, 1] = k, v
        return kv[:, :, 0], kv[:, :, 1]
    return k.clone(), v.clone()


def _outcome(fn):
    try:
        return fn(), None
    except (RuntimeError, ValueError) as e:
        return None, (type(e), str(e).replace("RingCausalKVCache", "CausalKVCache"))


@st.composite
def scenarios(draw):
    size = draw(st.integers(2, 10))
    heads = draw(st.integers(1, 3))
    slicing = draw(st.sampled_from(["full", "split", "partial"]))
    if slicing == "full":
        slices = [None]
    elif slicing == "split":
        slices = [(h, 1) for h in range(heads)]
    else:
        slices = [(heads - 1, 1)]
    sink = draw(st.integers(0, min(3, size - 1)))
    config = dict(
        batch=draw(st.integers(1, 2)), size=size, heads=heads, dim=draw(st.integers(1, 2)),
        fused=draw(st.booleans()), slices=slices,
        sink_tokens=sink, global_sink_tokens=draw(st.integers(0, min(2, size - 1))),
        attention_window_size=draw(st.none() | st.integers(1, size)),
    )
    op = st.one_of(
        st.tuples(st.just("append"), st.integers(0, 5), st.integers(1, 4), st.none() | st.integers(0, 4)),
        st.tuples(st.just("append"), st.integers(0, 0), st.integers(1, 4), st.none()),
        st.tuples(st.just("rewrite"), st.integers(0, 6), st.integers(1, 4), st.none() | st.integers(0, 4)),
        st.tuples(st.just("reset"), st.just(0), st.just(0), st.none()),
    )
    return config, draw(st.lists(op, min_size=1, max_size=14))


class TestAgainstRollLayout(unittest.TestCase):
    seen: Counter

    def setUp(self):
        self.seen = Counter()  # which cases the schedules reached (so the test cannot pass vacuously)

    def run_schedule(self, config, ops):
        batch, size, heads, dim = (config[k] for k in ("batch", "size", "heads", "dim"))
        fused, slices = config["fused"], config["slices"]
        kw = {k: config[k] for k in ("sink_tokens", "global_sink_tokens", "attention_window_size")}
        roll = CausalKVCache(*_clone_buffers(batch, size, heads, dim, fused), **kw)
        ring = RingCausalKVCache(*_clone_buffers(batch, size, heads, dim, fused), **kw)
        written_heads = set(range(heads)) if slices == [None] else {h for h, _ in slices}
        label = 1000
        g = 0  # the roll cache's global end (read after each whole lockstep step)
        for kind, back, n, recent in ops:
            if kind == "reset":
                roll.reset(), ring.reset()
                g = 0
                continue
            start = g + (0 if back == 0 else -back) if kind == "rewrite" else g + (1 if back == 5 else 0)
            for sl in slices:
                h = heads if sl is None else sl[1]
                label += 1
                gen = torch.Generator().manual_seed(label)
                key = torch.randn(batch, n, h, dim, generator=gen, dtype=torch.float64)
                value = torch.randn(batch, n, h, dim, generator=gen, dtype=torch.float64)
                key[..., 0] = torch.arange(start, start + n, dtype=torch.float64).view(1, n, 1)  # K encodes positions
                head = None if sl is None else sl[0]
                before = (ring.k.clone(), ring.v.clone())
                roll_l0 = getattr(roll._cursors.get((0, heads) if sl is None else (sl[0], sl[0] + 1)), "local_end", 0)
                want, want_err = _outcome(lambda: roll.update_and_get_attention_kv(key, value, start, head, recent))
                got, got_err = _outcome(lambda: ring.update_and_get_attention_kv(key, value, start, head, recent))
                self.assertEqual(got_err, want_err)
                if want_err is not None:
                    self.assertTrue(torch.equal(ring.k, before[0]) and torch.equal(ring.v, before[1]))
                    continue
                self.assertIsInstance(got, RingKVView)
                self.seen["evicting append"] += want.visible_global_end - want.visible_local_end > g - roll_l0
                self.seen["ring-order view"] += got.k.shape[1] > 0 and not torch.equal(got.k, want.k)
                self.seen["view in several segments"] += len(got.segments) > 1
                self.seen["W < S"] += config["attention_window_size"] not in (None, size)
                self.seen["recent_window_tokens"] += recent is not None
                self.seen["head slice"] += head is not None
                self.assertEqual(tuple(got[2:6]), tuple(want[2:]))
                k_ord, v_ord = got.ordered()
                self.assertTrue(torch.equal(k_ord, want.k) and torch.equal(v_ord, want.v))
                self.assertTrue(torch.equal(RingCausalKVCache.ordered(got)[0], want.k))
                pos = got.positions
                self.assertEqual(pos.shape, (got.k.shape[1],))
                # the same (position -> row) pairs: sorting the ring view by position gives the roll view
                self.assertTrue(torch.equal(got.k[:, pos.argsort()], want.k))
                self.assertTrue(torch.equal(got.v[:, pos.argsort()], want.v))
                # each row's reported position is the one its K was written for (K[..., 0] encodes it)
                want_pos = pos.to(torch.float64).view(1, -1, 1).expand_as(got.k[..., 0])
                self.assertTrue(torch.equal(got.k[..., 0], want_pos))
            g = roll.global_end
        # heads no writer owns keep their sentinels, in both layouts
        fresh_k, fresh_v = sentinel_cache(batch, size, heads, dim, fused)
        for h in set(range(heads)) - written_heads:
            self.assertTrue(torch.equal(ring.k[:, :, h], fresh_k[:, :, h]))
            self.assertTrue(torch.equal(ring.v[:, :, h], fresh_v[:, :, h]))

    def test_random_schedules(self):
        @settings(derandomize=True, max_examples=250, deadline=None)
        @given(scenarios())
        def run(scenario):
            self.run_schedule(*scenario)

        run()
        for case in ("evicting append", "ring-order view", "view in several segments", "W < S",
                     "recent_window_tokens", "head slice"):
            self.assertGreater(self.seen[case], 20, (case, self.seen))

    def test_long_stream_wraps(self):
        """Many evictions with a chunk that does not divide the ring: every wrap position is reached."""
        config = dict(batch=1, size=11, heads=2, dim=2, fused=True, slices=[(0, 1), (1, 1)], sink_tokens=2,
                      global_sink_tokens=0, attention_window_size=None)
        ops = [("append", 0, 3, None), ("rewrite", 3, 3, None)] * 20 + [("append", 0, 4, 2), ("rewrite", 2, 2, 0)] * 5
        self.run_schedule(config, ops)
        config.update(attention_window_size=6, slices=[None], fused=False)
        self.run_schedule(config, ops)


class TestBytesWritten(unittest.TestCase):
    def test_evicting_append_writes_only_the_chunk(self):
        calls = []
        real = ring_module.cache_write

        def counting(key, value, k_cache, v_cache, start, head_start=None):
            calls.append((start, key.shape[1]))
            real(key, value, k_cache, v_cache, start, head_start)

        size, sink, n, heads, dim = 21, 3, 4, 2, 3
        k, v = sentinel_cache(1, size, heads, dim, fused=True)
        cache = RingCausalKVCache(k, v, sink_tokens=sink)
        ring_module.cache_write = counting
        try:
            s, wraps = 0, 0
            for step in range(40):
                key = torch.full((1, n, heads, dim), 1e6 + step, dtype=torch.float64)
                before_k, before_v = cache.k.clone(), cache.v.clone()
                calls.clear()
                view = cache.update_and_get_attention_kv(key, -key, s)
                changed = ((cache.k != before_k).flatten(2).any(-1) | (cache.v != before_v).flatten(2).any(-1))
                self.assertEqual(sum(c for _, c in calls), n)  # rows handed to cache_write: the chunk
                self.assertLessEqual(len(calls), 2)
                self.assertEqual(int(changed.sum()), n)  # rows that changed in the buffers: the chunk's
                wraps += len(calls) == 2
                if s + n > size:  # an evicting append: the sink rows are untouched
                    self.assertFalse(bool(changed[:, :sink].any()))
                calls.clear()
                cache.update_and_get_attention_kv(key + 1, -key - 1, s)  # a rewrite writes the chunk's rows
                self.assertEqual(sum(c for _, c in calls), n)
                s = view.visible_global_end
            self.assertGreater(wraps, 0)
        finally:
            ring_module.cache_write = real

    def test_full_window_view_is_the_buffer(self):
        """W = S and a full cache: the view is the whole buffer (no copy), in ring order."""
        cache = RingCausalKVCache.allocate(1, 12, 2, 4, dtype=torch.float32, sink_tokens=2)
        for i in range(9):
            view = cache.update_and_get_attention_kv(torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4), 3 * i)
        self.assertEqual(view.k.data_ptr(), cache.k.data_ptr())
        self.assertEqual(view.k.shape[1], 12)
        self.assertEqual(sorted(view.positions.tolist()), [0, 1] + list(range(27 - 10, 27)))


class TestUnsupported(unittest.TestCase):
    def test_allow_growth(self):
        k = torch.zeros(1, 4, 1, 2)
        with self.assertRaisesRegex(ValueError, "allow_growth=True is not supported .* use CausalKVCache"):
            RingCausalKVCache(k, k.clone(), allow_growth=True)

    def test_pin(self):
        cache = RingCausalKVCache.allocate(1, 8, 1, 2, sink_tokens=2)
        cache.update_and_get_attention_kv(torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2), 0)
        with self.assertRaisesRegex(ValueError, "pinned chunks are not supported .* use CausalKVCache"):
            cache.pin_current_chunk(2)


class TestCompile(unittest.TestCase):
    def test_stream_compiles_bounded_graphs(self):
        """A compiled stream (append + rewrite per chunk, wrapping ring): a bounded number of graphs, none after
        the ring offset has taken each of its values once."""
        torch._dynamo.reset()
        frames = []

        def backend(gm, example_inputs):
            frames.append(gm)
            return gm

        size, sink, n = 10, 1, 3  # ring of 9 rows, chunk 3: offsets 0, 3, 6, also wraps mid-chunk with n=4
        cache = RingCausalKVCache.allocate(1, size, 2, 4, dtype=torch.float32, sink_tokens=sink)

        @torch.compile(fullgraph=True, backend=backend)
        def step(caches, key, value, start: int):
            view = caches[0].update_and_get_attention_kv(key, value, start)
            q = key.transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(q, view.k.transpose(1, 2), view.v.transpose(1, 2))

        roll = CausalKVCache.allocate(1, size, 2, 4, dtype=torch.float32, sink_tokens=sink)
        counts = []
        for i in range(24):
            key, value = torch.randn(1, n, 2, 4), torch.randn(1, n, 2, 4)
            out = step([cache], key, value, n * i)
            ref_view = roll.update_and_get_attention_kv(key, value, n * i)
            ref = torch.nn.functional.scaled_dot_product_attention(
                key.transpose(1, 2), ref_view.k.transpose(1, 2), ref_view.v.transpose(1, 2))
            torch.testing.assert_close(out, ref)  # unmasked attention: ring order gives the same output
            step([cache], key, value, n * i)  # rewrite
            counts.append(len(frames))
        # measured on torch 2.13: [2, 3, 3, 5, 6, 6, ...]: 6 graphs, the last one at chunk 5
        self.assertLessEqual(counts[-1], 8, f"graphs after each chunk: {counts}")
        self.assertEqual(counts[-1], counts[8], f"graphs after each chunk: {counts}")


if __name__ == "__main__":
    unittest.main()

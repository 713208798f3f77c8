"""PackedCausalKVCache against the dense CausalKVCache: bit-exact while every segment is dense, per-format tolerances
after; random chunk schedules (hypothesis, derandomized); sentinel heads; memory; the three documented errors."""

from __future__ import annotations

import unittest

import expecttest
import torch
import torch._dynamo
from hypothesis import given, settings
from hypothesis import strategies as st

from kvops.cache import CausalKVCache, PackedCausalKVCache
from kvops.packed import dequantize_kv, materialize, packed_attention
from kvops.cache._packed_pool import pool_slot
from tests.contract import raises_everywhere

UNSUPPORTED = torch._dynamo.exc.Unsupported  # how Dynamo (fullgraph) reports an exception raised by traced Python
# Relative RMS error of the whole visible K/V (bf16) once chunks are packed, for the synthetic K/V of kv_chunk below
# (two x10 outlier channels; measured worst in test_formats_within_tolerance: int8 0.014, fp8 0.023, int4 0.157,
# int2 with one stage 0.296)
TOLERANCE = {"int8": 0.03, "fp8": 0.05, "int4": 0.25, "int2": 0.45}


def kv_chunk(g: torch.Generator, b, n, h, d, dtype=torch.float32):
    """Clustered tokens with a few outlier channels (x10), as video-latent K/V."""
    centers = torch.randn(b, 3, h, d, generator=g) * 2
    x = centers[:, torch.randint(0, 3, (n,), generator=g)] + 0.3 * torch.randn(b, n, h, d, generator=g)
    x[..., :2] *= 10
    return x.to(dtype)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean().clamp(min=1e-30)).sqrt().item()


def attention64(q, k, v):
    """fp64 softmax attention (GQA: query head h reads KV head h // (H_q / H_kv))."""
    k, v = (x.double().repeat_interleave(q.shape[2] // x.shape[2], 2) for x in (k, v))
    sc = torch.einsum("bthd,bshd->bhts", q.double(), k) * q.shape[-1] ** -0.5
    return torch.einsum("bhts,bshd->bthd", sc.softmax(-1), v)


class Pair:
    """A dense CausalKVCache and a PackedCausalKVCache of one geometry, fed the same calls and compared."""

    def __init__(self, test, *, b=1, size=12, heads=2, dim=64, chunk=3, sink=0, quant=None, keep=1, window=None,
                 quantize_sink=False, global_sink=0, pinnable=False, dtype=torch.float32, **fmt):
        self.test, self.quant, self.chunk = test, quant, chunk
        self.dense = CausalKVCache.allocate(b, size, heads, dim, dtype=dtype, sink_tokens=sink,
                                            global_sink_tokens=global_sink, attention_window_size=window)
        self.packed, self.segs = (PackedCausalKVCache.allocate(
            b, size, heads, dim, chunk_tokens=chunk, quant=quant, keep_recent_chunks=keep, sink_tokens=sink,
            global_sink_tokens=global_sink, attention_window_size=window, quantize_sink=quantize_sink,
            pinnable=pinnable, dtype=dtype, **fmt) for _ in range(2))
        self.shape, self.dtype = (b, chunk, heads, dim), dtype
        self.g, self.gq = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
        self.worst = 0.0

    def call(self, s, recent=None, slices=None, exact=None):
        b, n, h, d = self.shape
        for h0, h1 in slices or [(0, h)]:
            k, v = kv_chunk(self.g, b, n, h1 - h0, d, self.dtype), kv_chunk(self.g, b, n, h1 - h0, d, self.dtype)
            start = None if slices is None else h0
            want = self.dense.update_and_get_attention_kv(k, v, s, start, recent)
            got = self.packed.update_and_get_attention_kv(k, v, s, start, recent)
            self.test.assertEqual(tuple(got[2:]), tuple(want[2:]))
            self.check_segments(self.segs.update(k, v, s, start, recent), got)
            self.test.assertEqual(got.k.shape, want.k.shape)
            self.test.assertEqual(got.k.dtype, want.k.dtype)
            if exact if exact is not None else self.quant is None:
                self.test.assertTrue(torch.equal(got.k, want.k) and torch.equal(got.v, want.v))
            else:
                err = max(rel_rms(got.k, want.k), rel_rms(got.v, want.v))
                self.worst = max(self.worst, err)
                self.test.assertLess(err, TOLERANCE[self.quant])
            # the chunk just written is dense: bit-exact in the view
            le, ls = got.visible_local_end, got.local_start_index
            if recent is None and self.packed.attention_window_size >= self.packed.cache_size:
                self.test.assertTrue(torch.equal(got.k[:, ls:le], k))

    def check_segments(self, view, gathered):
        """``update()`` (the storage + row_counts) + ``packed_attention`` against the rows that
        ``update_and_get_attention_kv`` gathered from an identical cache: the rows ``row_counts`` marks (dequantized
        in the cache dtype, as the gather does) give the gathered window's fp64 attention up to summation order (the
        same rows, another order), and the fused kernel (which dequantizes in fp32) matches fp64 attention over the
        rows dequantized in fp32. GQA 2:1."""
        self.test.assertEqual(tuple(view[2:]), tuple(gathered[2:]))
        self.test.assertEqual(int(view.k.row_counts.sum()), gathered.k.shape[1])
        b, _, h, d = gathered.k.shape
        q = torch.randn(b, 2, 2 * h, d, generator=self.gq) * 0.1
        got = packed_attention(q, view.k, view.v)
        if gathered.k.shape[1] == 0:
            self.test.assertTrue(torch.equal(got, torch.zeros_like(got)))
            return
        marked = attention64(q, materialize(view.k, self.dtype), materialize(view.v, self.dtype))
        torch.testing.assert_close(marked, attention64(q, gathered.k, gathered.v), rtol=1e-9, atol=1e-9)
        want = attention64(q, materialize(view.k, torch.float32), materialize(view.v, torch.float32))
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)

    def chunk_steps(self, s, steps=2, recent=None, slices=None, exact=None, pin=False):
        for _ in range(1 + steps):  # append, then rewrites (denoising steps, context pass)
            self.call(s, recent, slices, exact)
        if pin:  # pin the chunk just written (LongLive's shot sink), in both caches
            self.dense.pin_current_chunk(self.chunk)
            self.packed.pin_current_chunk(self.chunk)
            self.segs.pin_current_chunk(self.chunk)
            self.test.assertEqual(self.packed.pinned_len, self.dense.pinned_len)


class TestDifferential(unittest.TestCase):
    def test_dense_mode_is_bit_exact(self):
        for sink, recent in ((0, None), (2, None), (4, 1), (0, 0)):
            p = Pair(self, size=13, chunk=3, sink=sink, quant=None)
            for c in range(9):
                p.chunk_steps(3 * c, recent=recent)

    def test_bit_exact_until_the_first_chunk_is_packed(self):
        for quant in TOLERANCE:
            p = Pair(self, size=12, chunk=3, quant=quant, keep=1)
            p.chunk_steps(0, exact=True)
            p.chunk_steps(3, exact=True)  # chunks 0 (recent) and 1 (current) are dense
            p.chunk_steps(6, exact=False)  # chunk 0 is packed now
            self.assertGreater(p.worst, 0.0)

    def test_formats_within_tolerance(self):
        worst = {}
        for quant in TOLERANCE:
            for keep, sink, qsink in ((0, 0, False), (1, 2, False), (2, 4, True)):
                p = Pair(self, size=40, chunk=8, quant=quant, keep=keep, sink=sink, quantize_sink=qsink,
                         dtype=torch.bfloat16, num_clusters=2)
                for c in range(7):
                    p.chunk_steps(8 * c, steps=1, recent=None if c % 3 else 5)
                worst[quant] = max(worst.get(quant, 0.0), p.worst)
        self.assertTrue(all(e > 0 for e in worst.values()), worst)

    def test_attention_window_smaller_than_the_cache(self):
        """W is the whole visible budget (sink + newest rows), as CausalKVCache (docs/semantics.md §1.6)."""
        for quant, window, sink in ((None, 7, 2), ("int8", 7, 2), ("int4", 5, 0), ("fp8", 4, 3)):
            p = Pair(self, size=15, chunk=3, quant=quant, keep=1, sink=sink, window=window)
            for c in range(9):
                p.chunk_steps(3 * c, recent=None if c % 2 else 2)

    def test_head_sliced_writers_in_lockstep(self):
        for quant in (None, "int4"):
            p = Pair(self, size=12, heads=4, chunk=3, sink=1, quant=quant, keep=0)
            for c in range(7):
                p.chunk_steps(3 * c, slices=[(0, 2), (2, 4)])

    def test_head_dim_80_gqa_shapes(self):
        p = Pair(self, b=2, size=10, heads=5, dim=80, chunk=2, quant="int2", keep=0, group_size=80, stages=2)
        for c in range(7):
            p.chunk_steps(2 * c, steps=1)


class TestPinnedChunk(unittest.TestCase):
    """A pinned chunk (CausalKVCache.pin_current_chunk, docs/semantics.md §1.2 and §1.7) is kept through eviction,
    first moving down with the rows after the global sink, then right after it."""

    def test_dense_mode_is_bit_exact(self):
        for sink, global_sink, pin_at, window, recent in ((3, 0, 1, None, None), (2, 1, 2, None, None),
                                                          (3, 2, 1, 8, None), (4, 0, 3, None, 2), (3, 0, 0, None, 1)):
            p = Pair(self, size=13, chunk=3, sink=sink, global_sink=global_sink, pinnable=True, window=window)
            for c in range(10):
                p.chunk_steps(3 * c, pin=c == pin_at, recent=None if c % 2 else recent)
            self.assertGreater(p.dense.global_end, p.dense.cache_size)  # evicted past the pin

    def test_quantized_within_tolerance(self):
        for quant, qsink, keep in (("int8", False, 0), ("int4", True, 1), ("int2", True, 0), ("fp8", False, 1)):
            p = Pair(self, size=14, chunk=3, sink=3, quant=quant, keep=keep, quantize_sink=qsink, pinnable=True,
                     num_clusters=2)
            p.chunk_steps(0, exact=True)
            for c in range(1, 9):
                p.chunk_steps(3 * c, steps=1, pin=c == 2)
            self.assertGreater(p.worst, 0.0)

    def test_pin_errors(self):
        c = PackedCausalKVCache.allocate(1, 12, 2, 32, chunk_tokens=3, quant="int8", sink_tokens=3)
        x = torch.ones(1, 3, 2, 32)
        c.update_and_get_attention_kv(x, x, 0)
        with self.assertRaisesRegex(ValueError, "build the cache with pinnable=True"):
            c.pin_current_chunk(3)
        c = PackedCausalKVCache.allocate(1, 12, 2, 32, chunk_tokens=3, quant="int8", sink_tokens=3, pinnable=True)
        c.update_and_get_attention_kv(x, x, 0)
        with self.assertRaisesRegex(ValueError, "only tokens of the current chunk can be pinned"):
            c.pin_current_chunk(4)
        for i in range(1, 5):
            c.update_and_get_attention_kv(x, x, 3 * i)  # evicts: rows [0, 3) hold the sink
        with self.assertRaisesRegex(NotImplementedError, "pins before the first eviction"):
            c.pin_current_chunk(3)
        c.pin_current_chunk(0)  # clears
        self.assertEqual(c.pinned_len, 0)


# --- hypothesis schedules ----------------------------------------------------------------------------------------
@st.composite
def schedules(draw):
    chunk = draw(st.integers(1, 4))
    sink = draw(st.integers(0, 5))
    size = sink + chunk * draw(st.integers(1, 4)) + draw(st.integers(0, chunk - 1))
    heads = draw(st.integers(1, 3))
    slices = draw(st.sampled_from([None, "split"])) if heads > 1 else None
    window = draw(st.none() | st.integers(1, size + 2))
    config = dict(size=size, heads=heads, dim=draw(st.sampled_from([32, 64])), chunk=chunk, sink=sink, window=window,
                  quant=draw(st.sampled_from([None, "int8", "fp8", "int4", "int2"])), keep=draw(st.integers(0, 2)),
                  quantize_sink=draw(st.booleans()), b=draw(st.integers(1, 2)),
                  global_sink=draw(st.integers(0, sink)), pinnable=draw(st.booleans()))
    plan = draw(st.lists(st.tuples(st.integers(0, 3), st.none() | st.integers(0, 5)), min_size=1, max_size=9))
    return config, slices, plan, draw(st.booleans())


class TestRandomSchedules(unittest.TestCase):
    @settings(derandomize=True, max_examples=40, deadline=None)
    @given(schedules())
    def test_random_schedules(self, scenario):
        config, slicing, plan, reset = scenario
        p = Pair(self, **config)
        h = config["heads"]
        slices = [(i, i + 1) for i in range(h)] if slicing == "split" else None
        for rounds in range(2 if reset else 1):
            for i, (steps, recent) in enumerate(plan):
                # pin a chunk appended past the global sink before the first eviction (the packed cache's domain)
                end, gs = (i + 1) * config["chunk"], config["global_sink"]
                pin = config["pinnable"] and i == len(plan) // 3 and gs <= end - config["chunk"] and \
                    end <= config["size"] and config["sink"] > 0
                p.chunk_steps(i * config["chunk"], steps=steps, recent=recent, slices=slices, pin=pin)
            if reset:
                p.dense.reset()
                p.packed.reset()
                p.segs.reset()


class TestStorage(unittest.TestCase):
    def test_untouched_heads_stay_zero(self):
        """A writer of heads [1, 3) of 4: heads 0 and 3 of every buffer and pool read back as the initial zeros."""
        for quant in ("int8", "fp8", "int4", "int2"):
            c = PackedCausalKVCache.allocate(1, 12, 4, 64, chunk_tokens=3, quant=quant, keep_recent_chunks=0,
                                             sink_tokens=2, dtype=torch.float32)
            g = torch.Generator().manual_seed(1)
            for i in range(6):
                for _ in range(2):
                    x = kv_chunk(g, 1, 3, 2, 64)
                    view = c.update_and_get_attention_kv(x, x + 1, 3 * i, cache_head_start=1)
                    self.assertEqual(view.k.shape[2], 2)
            for t in (c.k_ring, c.v_ring, c.k_sink, c.v_sink):
                self.assertTrue(bool((t[:, :, [0, 3]] == 0).all()))
                self.assertTrue(bool((t[:, :, 1:3] != 0).any()))
            for pool in (c.packed_slots("pool", 0), c.packed_slots("pool", 1)):
                for slot in range(c.pool_chunks):
                    dense = dequantize_kv(pool_slot(pool, slot, c.pool_chunks), torch.float32)
                    self.assertTrue(bool((dense[:, :, [0, 3]] == 0).all()), quant)

    def test_nbytes_counts_every_tensor_held(self):
        for quant in (None, "int8", "fp8", "int4", "int2"):
            c = PackedCausalKVCache.allocate(1, 40, 2, 64, chunk_tokens=8, quant=quant, sink_tokens=4,
                                             quantize_sink=quant == "int2", dtype=torch.bfloat16)
            held = {}
            for value in vars(c).values():
                for t in (value.tensors() if hasattr(value, "tensors") else [value]):
                    if isinstance(t, torch.Tensor):
                        held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            self.assertEqual(sum(held.values()), c.nbytes, quant)

    def test_resident_bytes_go_down(self):
        dense = 2 * 1 * 512 * 2 * 128 * 2  # bf16 K+V of S=512 rows, 2 heads, D=128
        ratios = {}
        for quant, target in (("int8", 0.53), ("fp8", 0.53), ("int4", 0.30), ("int2", 0.23)):
            # one dense chunk (the current one) of 8, the rest packed, plus the scratch slot a rewrite quantizes
            # into (one packed chunk shared by K and V: half a chunk of each)
            bound = 1 / 8 + 7.5 / 8 * target
            # int2: 4 centroids of 128 fp16 amortized over a chunk of 64 tokens add 16 bytes per (token, head)
            c = PackedCausalKVCache.allocate(1, 512, 2, 128, chunk_tokens=64, quant=quant, keep_recent_chunks=0,
                                             dtype=torch.bfloat16, num_clusters=4)
            ratios[quant] = c.nbytes / dense
            self.assertLessEqual(ratios[quant], bound, quant)
        self.assertLess(ratios["int2"], ratios["int4"])

    @unittest.skipUnless(torch.cuda.is_available(), "the CUDA caching allocator is measured on a GPU only")
    def test_allocator_bytes_match_nbytes(self):
        before = torch.cuda.memory_allocated()
        c = PackedCausalKVCache.allocate(1, 4096, 8, 128, chunk_tokens=512, quant="int4", keep_recent_chunks=0,
                                         dtype=torch.bfloat16, device="cuda")
        x = torch.randn(1, 512, 8, 128, dtype=torch.bfloat16, device="cuda")
        for i in range(12):
            c.update_and_get_attention_kv(x, x, 512 * i)
        del x
        torch.cuda.synchronize()
        self.assertLessEqual(torch.cuda.memory_allocated() - before, c.nbytes + 2**20)


# --- the three documented errors, identical in eager, torch.compile(fullgraph=True) and torch.export ------------
class TestErrors(expecttest.TestCase):
    def cache(self):
        c = PackedCausalKVCache.allocate(1, 8, 4, 32, chunk_tokens=2, quant="int8", keep_recent_chunks=0,
                                         dtype=torch.float32)
        x = torch.ones(1, 2, 4, 32)
        c.update_and_get_attention_kv(x, x, 0)
        c.update_and_get_attention_kv(x, x, 2)
        return c

    def check(self, exc, fn, *args):
        return raises_everywhere(self, exc, fn, args, compile_exc=UNSUPPORTED)

    def test_head_slice_requires_cache_head_start(self):
        c = self.cache()
        msg = self.check(ValueError, lambda k: c.update_and_get_attention_kv(k, k, 4), torch.ones(1, 2, 2, 32))
        self.assertExpectedInline(msg, """PackedCausalKVCache: cache_head_start required for head slice (key has 2 heads, the cache 4; pass cache_head_start with 0 <= cache_head_start <= 2, or key/value with all 4 heads)""")

    def test_rewrite_size_changed(self):
        c = self.cache()
        msg = self.check(NotImplementedError, lambda k: c.update_and_get_attention_kv(k, k, 2), torch.ones(1, 3, 4, 32))
        self.assertExpectedInline(msg, """PackedCausalKVCache: current-chunk rewrite size changed (the current chunk at current_start=2 holds 2 tokens, the rewrite 3; rewrite it with the same 2 tokens)""")

    def test_non_sequential_write(self):
        c = self.cache()
        msg = self.check(NotImplementedError, lambda k: c.update_and_get_attention_kv(k, k, 0), torch.ones(1, 2, 4, 32))
        self.assertExpectedInline(msg, """PackedCausalKVCache: non-sequential write current_start=0 global_end=4 cur=2. The packed cache takes chunks in order: pass current_chunk_start=4 to append the next chunk, or current_chunk_start=2 to rewrite the current chunk (a denoising step).""")
        fresh = PackedCausalKVCache.allocate(1, 8, 4, 32, chunk_tokens=2, quant=None, dtype=torch.float32)
        msg = self.check(NotImplementedError, lambda k: fresh.update_and_get_attention_kv(k, k, 2), torch.ones(1, 2, 4, 32))
        self.assertExpectedInline(msg, """PackedCausalKVCache: non-sequential write current_start=2 global_end=0 cur=None. The packed cache takes chunks in order: pass current_chunk_start=0 to append the next chunk.""")

    def test_nothing_changes_on_error(self):
        c = self.cache()
        before = (c.global_end, c.current_start, c.k_ring.clone(), c.pool.codes.clone())
        with self.assertRaises(NotImplementedError):
            c.update_and_get_attention_kv(torch.zeros(1, 2, 4, 32), torch.zeros(1, 2, 4, 32), 6)
        self.assertEqual((c.global_end, c.current_start), before[:2])
        self.assertTrue(torch.equal(c.k_ring, before[2]) and torch.equal(c.pool.codes, before[3]))


if __name__ == "__main__":
    unittest.main()

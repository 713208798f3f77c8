"""kvops.cache_write / kvops.cache_roll: bit-exact data movement, contracts in every mode, opcheck."""

import itertools
import unittest

import expecttest
import torch

import kvops
from tests.contract import raises_everywhere

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SENTINEL = -7.0


def make_caches(b, s, h, d, d_v=None, dtype=torch.float32, layout="separate", device="cpu"):
    """Sentinel-filled caches. layout: separate | joint ([B, S, 2, H, D] viewed as K and V) | head_slice (heads 2..)."""
    d_v = d if d_v is None else d_v
    if layout == "separate":
        full = lambda *shape: torch.full(shape, SENTINEL, dtype=dtype, device=device)  # noqa: E731
        return full(b, s, h, d), full(b, s, h, d_v)
    if layout == "joint":
        assert d == d_v
        kv = torch.full((b, s, 2, h, d), SENTINEL, dtype=dtype, device=device)
        return kv[:, :, 0], kv[:, :, 1]
    if layout == "head_slice":  # a view of heads [2, 2+h) of a wider cache
        k = torch.full((b, s, h + 3, d), SENTINEL, dtype=dtype, device=device)
        v = torch.full((b, s, h + 3, d_v), SENTINEL, dtype=dtype, device=device)
        return k[:, :, 2 : 2 + h], v[:, :, 2 : 2 + h]
    raise ValueError(layout)


def ref_write(k_cache, v_cache, key, value, start, h0):
    """Plain per-element reference: a copy of the caches with the tokens written one (b, t, h) at a time."""
    k, v = k_cache.clone(), v_cache.clone()
    for b, t, h in itertools.product(range(key.shape[0]), range(key.shape[1]), range(key.shape[2])):
        k[b, start + t, h0 + h] = key[b, t, h]
        v[b, start + t, h0 + h] = value[b, t, h]
    return k, v


def ref_roll(cache, src, dst, n, h0, h1):
    out = cache.clone()
    rows = [cache[:, src + i, h0:h1].clone() for i in range(n)]
    for i, row in enumerate(rows):
        out[:, dst + i, h0:h1] = row
    return out


class TestCacheWrite(expecttest.TestCase):
    def test_matches_reference(self):
        cases = [  # (B, S, H_cache, H_in, D, D_v, start, T, cache_head_start, layout)
            (2, 16, 4, 4, 64, 64, 0, 5, None, "separate"),
            (1, 9, 5, 1, 80, 80, 8, 1, 4, "separate"),  # head_dim 80, one head of five, last row
            (2, 12, 6, 2, 80, 48, 3, 7, 2, "separate"),  # D_v != D
            (3, 8, 4, 4, 16, 16, 2, 0, None, "separate"),  # zero tokens
            (2, 10, 4, 3, 32, 32, 1, 4, 1, "joint"),  # K/V views of one [B, S, 2, H, D] allocation
            (1, 7, 3, 3, 8, 8, 4, 3, None, "head_slice"),  # strided view of a wider cache
        ]
        for dtype, case in itertools.product(DTYPES, cases):
            b, s, hc, hi, d, dv, start, t, h0, layout = case
            with self.subTest(dtype=dtype, case=case):
                k_cache, v_cache = make_caches(b, s, hc, d, dv, dtype, layout)
                key = torch.randn(b, t, hi, d).to(dtype)
                value = torch.randn(b, t, hi, dv).to(dtype)
                want_k, want_v = ref_write(k_cache, v_cache, key, value, start, h0 or 0)
                k_ptr = k_cache.data_ptr()
                kvops.cache_write(key, value, k_cache, v_cache, start, cache_head_start=h0)
                self.assertEqual(k_cache.data_ptr(), k_ptr)
                self.assertTrue(torch.equal(k_cache, want_k))
                self.assertTrue(torch.equal(v_cache, want_v))

    def test_joint_allocation_other_half_untouched(self):
        kv = torch.full((1, 6, 2, 2, 4), SENTINEL)
        key, value = torch.ones(1, 2, 2, 4), torch.full((1, 2, 2, 4), 2.0)
        kvops.cache_write(key, value, kv[:, :, 0], kv[:, :, 1], 3)
        self.assertTrue(torch.equal(kv[:, 3:5, 0], key))
        self.assertTrue(torch.equal(kv[:, 3:5, 1], value))
        self.assertTrue(bool((kv[:, :3] == SENTINEL).all()) and bool((kv[:, 5:] == SENTINEL).all()))

    def test_noncontiguous_key(self):
        k_cache, v_cache = make_caches(2, 8, 4, 16)
        key = torch.randn(2, 4, 3, 16).transpose(1, 2)  # [B, T=3, H=4, D] with permuted strides
        value = torch.randn(2, 16, 3, 4).permute(0, 2, 3, 1)
        want_k, want_v = ref_write(k_cache, v_cache, key, value, 5, 0)
        kvops.cache_write(key, value, k_cache, v_cache, 5)
        self.assertTrue(torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v))


class TestCacheRoll(expecttest.TestCase):
    def test_matches_reference(self):
        cases = [  # (S, H, src, dst, n, cache_head_start, num_heads, layout)
            (12, 3, 5, 2, 6, None, None, "separate"),  # overlapping move down (eviction)
            (12, 3, 2, 5, 6, None, None, "separate"),  # overlapping move up
            (12, 3, 8, 0, 4, None, None, "separate"),  # disjoint
            (12, 5, 4, 1, 7, 1, 2, "separate"),  # head slice, overlapping
            (10, 4, 3, 3, 5, None, None, "joint"),  # src == dst: no-op
            (10, 4, 6, 2, 4, 0, 4, "joint"),
            (9, 3, 4, 1, 0, None, None, "head_slice"),  # zero rows
            (9, 3, 5, 1, 4, 2, 1, "head_slice"),
        ]
        for dtype, case in itertools.product(DTYPES, cases):
            s, h, src, dst, n, h0, nh, layout = case
            with self.subTest(dtype=dtype, case=case):
                k_cache, v_cache = make_caches(2, s, h, 8, 8, dtype, layout)
                k_cache.copy_(torch.randn(k_cache.shape).to(dtype))
                v_cache.copy_(torch.randn(v_cache.shape).to(dtype))
                lo = h0 or 0
                hi = h if nh is None else lo + nh
                want_k, want_v = ref_roll(k_cache, src, dst, n, lo, hi), ref_roll(v_cache, src, dst, n, lo, hi)
                kvops.cache_roll(k_cache, v_cache, src, dst, n, cache_head_start=h0, num_heads=nh)
                self.assertTrue(torch.equal(k_cache, want_k))
                self.assertTrue(torch.equal(v_cache, want_v))


def _caches(h=4, s=8, d=16):
    return torch.zeros(2, s, h, d), torch.zeros(2, s, h, d)


class TestContracts(expecttest.TestCase):
    """Every documented error: same type and message in eager, torch.compile(fullgraph=True) and torch.export."""

    def check(self, exc, fn, *args):
        return raises_everywhere(self, exc, fn, args)

    def test_missing_v_cache(self):
        k_cache, _ = _caches()
        key = torch.randn(2, 3, 4, 16)
        msg = self.check(ValueError, lambda key, kc: kvops.cache_write(key, key, kc, None, 0), key, k_cache)
        self.assertExpectedInline(msg, """kvops.cache_write: v_cache must be provided (the V cache written or read with k_cache).""")
        msg = self.check(ValueError, lambda kc: kvops.cache_roll(kc, None, 2, 0, 3), k_cache)
        self.assertExpectedInline(msg, """kvops.cache_roll: v_cache must be provided (the V cache written or read with k_cache).""")

    def test_missing_value(self):
        k_cache, v_cache = _caches()
        key = torch.randn(2, 3, 4, 16)
        msg = self.check(ValueError, lambda key, kc, vc: kvops.cache_write(key, None, kc, vc, 0), key, k_cache, v_cache)
        self.assertExpectedInline(
            msg,
            """kvops.cache_write: value must be provided (got value=None with a v_cache); pass value [B, T, H_in, D_v].""",
        )

    def test_head_count_without_cache_head_start(self):
        k_cache, v_cache = _caches(h=8)
        key = torch.randn(2, 3, 2, 16)
        msg = self.check(ValueError, lambda k, kc, vc: kvops.cache_write(k, k, kc, vc, 0), key, k_cache, v_cache)
        self.assertExpectedInline(
            msg, """kvops.cache_write requires cache_head_start when cache heads (8) differ from input heads (2). If the model has 2 KV heads, allocate the cache with 2 KV heads (num_kv_heads=2). A head slice is for several writers filling one cache (tensor-parallel writers): then pass cache_head_start (0 <= cache_head_start <= 6) to write the input heads as heads [cache_head_start, cache_head_start + 2), and have the other writers fill the other heads before attention. Or pass key/value with all 8 heads."""
        )

    def test_head_slice_outside_cache(self):
        k_cache, v_cache = _caches(h=8)
        key = torch.randn(2, 3, 2, 16)
        msg = self.check(ValueError, lambda k, kc, vc: kvops.cache_write(k, k, kc, vc, 0, 7), key, k_cache, v_cache)
        self.assertExpectedInline(
            msg,
            """kvops.cache_write: head slice [7, 9) is outside the cache's heads [0, 8). Pass 0 <= cache_head_start <= 6 for 2 input heads.""",
        )
        msg = self.check(ValueError, lambda kc, vc: kvops.cache_roll(kc, vc, 1, 0, 2, 6, 3), k_cache, v_cache)
        self.assertExpectedInline(
            msg,
            """kvops.cache_roll: head slice [6, 9) is outside the cache's heads [0, 8). Pass 0 <= cache_head_start <= 5 for 3 input heads.""",
        )

    def test_write_range(self):
        k_cache, v_cache = _caches(s=8)
        key = torch.randn(2, 3, 4, 16)
        msg = self.check(RuntimeError, lambda k, kc, vc: kvops.cache_write(k, k, kc, vc, 6), key, k_cache, v_cache)
        self.assertExpectedInline(
            msg,
            """Invalid kvops.cache_write write range: local=[6, 9), kv_cache_size=8, num_new_tokens=3. Rows must satisfy 0 <= start and start + num_new_tokens <= kv_cache_size. Pass start <= 5 (kv_cache_size - num_new_tokens), write at most 2 tokens at start=6, or allocate a cache of at least 9 rows (kvops.CausalKVCache evicts old rows when its cache is full).""",
        )
        msg = self.check(RuntimeError, lambda k, kc, vc: kvops.cache_write(k, k, kc, vc, -1), key, k_cache, v_cache)
        self.assertExpectedInline(
            msg,
            """Invalid kvops.cache_write write range: local=[-1, 2), kv_cache_size=8, num_new_tokens=3. Rows must satisfy 0 <= start and start + num_new_tokens <= kv_cache_size. Pass start >= 0 (the first cache row written).""",
        )

    def test_roll_range(self):
        k_cache, v_cache = _caches(s=8)
        msg = self.check(RuntimeError, lambda kc, vc: kvops.cache_roll(kc, vc, 5, 0, 4), k_cache, v_cache)
        self.assertExpectedInline(
            msg,
            """Invalid kvops.cache_roll range: src=[5, 9), dst=[0, 4), kv_cache_size=8, num_tokens=4. Both ranges must lie in [0, kv_cache_size) and num_tokens must be >= 0.""",
        )

    def test_dtype_mismatch(self):
        k_cache, v_cache = _caches()
        key = torch.randn(2, 3, 4, 16, dtype=torch.bfloat16)
        msg = self.check(ValueError, lambda k, kc, vc: kvops.cache_write(k, k, kc, vc, 0), key, k_cache, v_cache)
        self.assertExpectedInline(
            msg, """kvops.cache_write: key dtype torch.bfloat16 does not match k_cache dtype torch.float32. Cast key to torch.float32."""
        )
        msg = self.check(
            ValueError, lambda kc, vc: kvops.cache_roll(kc, vc, 0, 1, 1), k_cache, v_cache.to(torch.float16)
        )
        self.assertExpectedInline(
            msg,
            """kvops.cache_roll: v_cache dtype torch.float16 does not match k_cache dtype torch.float32. Cast v_cache to torch.float32.""",
        )

    def test_head_dim_and_batch_mismatch(self):
        k_cache, v_cache = _caches()
        key = torch.randn(2, 3, 4, 8)
        msg = self.check(ValueError, lambda k, kc, vc: kvops.cache_write(k, k, kc, vc, 0), key, k_cache, v_cache)
        self.assertExpectedInline(
            msg,
            """kvops.cache_write: head_dim mismatch: key has shape (2, 3, 4, 8) (head_dim 8) but k_cache has shape (2, 8, 4, 16) (head_dim 16).""",
        )
        key = torch.randn(3, 3, 4, 16)
        msg = self.check(ValueError, lambda k, kc, vc: kvops.cache_write(k, k, kc, vc, 0), key, k_cache, v_cache)
        self.assertExpectedInline(
            msg,
            """kvops.cache_write: batch mismatch: key has shape (3, 3, 4, 16) (batch 3) but k_cache has shape (2, 8, 4, 16) (batch 2).""",
        )

    def test_key_value_and_cache_shape_mismatch(self):
        k_cache, v_cache = _caches()
        key, value = torch.randn(2, 3, 4, 16), torch.randn(2, 2, 4, 16)
        msg = self.check(ValueError, lambda k, v, kc, vc: kvops.cache_write(k, v, kc, vc, 0), key, value, k_cache, v_cache)
        self.assertExpectedInline(
            msg,
            """kvops.cache_write: key shape (2, 3, 4, 16) and value shape (2, 2, 4, 16) must agree in [batch, num_new_tokens, num_heads].""",
        )
        msg = self.check(
            ValueError, lambda k, kc, vc: kvops.cache_write(k, k, kc, vc, 0), key, k_cache, torch.zeros(2, 9, 4, 16)
        )
        self.assertExpectedInline(
            msg,
            """kvops.cache_write: k_cache shape (2, 8, 4, 16) and v_cache shape (2, 9, 4, 16) must agree in [batch, cache_len, num_kv_heads]; only head_dim may differ.""",
        )

    def test_expanded_cache_cannot_be_written_in_place(self):
        k_cache = torch.zeros(1, 8, 4, 16).expand(2, 8, 4, 16)
        v_cache = torch.zeros(2, 8, 4, 16)
        key = torch.randn(2, 3, 4, 16)
        msg = self.check(ValueError, lambda k, kc, vc: kvops.cache_write(k, k, kc, vc, 0), key, k_cache, v_cache)
        self.assertExpectedInline(msg, """kvops.cache_write: k_cache of shape (2, 8, 4, 16) has stride 0 in dim 0 (an expanded view): its elements share memory, so it cannot be written in place. Allocate the cache with its own storage (e.g. torch.zeros, or .clone() the expanded view once).""")
        msg = self.check(ValueError, lambda kc, vc: kvops.cache_roll(vc, kc, 1, 0, 2), k_cache, v_cache)
        self.assertExpectedInline(msg, """kvops.cache_roll: v_cache of shape (2, 8, 4, 16) has stride 0 in dim 0 (an expanded view): its elements share memory, so it cannot be written in place. Allocate the cache with its own storage (e.g. torch.zeros, or .clone() the expanded view once).""")

    def test_roll_num_heads_not_positive(self):
        k_cache, v_cache = _caches(h=4)
        msg = self.check(ValueError, lambda kc, vc: kvops.cache_roll(kc, vc, 1, 0, 2, 0, 0), k_cache, v_cache)
        self.assertExpectedInline(msg, """kvops.cache_roll: num_heads must be positive, got 0. Pass the number of heads to move (or None for all heads from cache_head_start).""")

    def test_roll_head_start_outside_cache(self):
        k_cache, v_cache = _caches(h=4)
        msg = self.check(ValueError, lambda kc, vc: kvops.cache_roll(kc, vc, 1, 0, 2, 4), k_cache, v_cache)
        self.assertExpectedInline(msg, """kvops.cache_roll: cache_head_start=4 is outside the cache's heads [0, 4). Pass 0 <= cache_head_start < 4.""")

    def test_rank(self):
        k_cache, v_cache = _caches()
        key = torch.randn(2, 3, 64)
        msg = self.check(ValueError, lambda k, kc, vc: kvops.cache_write(k, k, kc, vc, 0), key, k_cache, v_cache)
        self.assertExpectedInline(
            msg,
            """kvops.cache_write: key must be 4-D [batch, num_new_tokens, num_heads, head_dim], got shape (2, 3, 64). Reshape key to [batch, num_new_tokens, num_heads, head_dim].""",
        )

    def test_range_error_fires_at_trace_time_with_dynamic_start(self):
        """After positions went dynamic, an out-of-range start still raises at trace time (recompile on guard)."""
        k_cache, v_cache = _caches(s=8)
        key = torch.randn(2, 3, 4, 16)
        torch._dynamo.reset()
        f = torch.compile(lambda k, kc, vc, s: kvops.cache_write(k, k, kc, vc, s), fullgraph=True, backend="eager")
        for s in range(4):
            f(key, k_cache, v_cache, s)
        with self.assertRaises(torch._dynamo.exc.TorchRuntimeError) as cm:
            f(key, k_cache, v_cache, 6)
        self.assertIn("RuntimeError('Invalid kvops.cache_write write range: local=[6, 9)", str(cm.exception))


class TestCompile(expecttest.TestCase):
    def test_positions_do_not_recompile_per_step(self):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        k_cache, v_cache = _caches(s=32)
        f = torch.compile(lambda k, kc, vc, s: kvops.cache_write(k, k * 2, kc, vc, s), fullgraph=True, backend="aot_eager")
        for s in range(20):
            f(torch.randn(2, 1, 4, 16), k_cache, v_cache, s)
        self.assertLessEqual(torch._dynamo.utils.counters["stats"]["unique_graphs"], 2)

    def test_compiled_equals_eager(self):
        torch._dynamo.reset()

        def step(x, kc, vc, s):  # exact producers (x * 2, -x): compiled sin/exp may differ from eager by an ulp
            kvops.cache_write(x * 2, -x, kc, vc, s, cache_head_start=1)
            kvops.cache_roll(kc, vc, 2, 0, 4, cache_head_start=1, num_heads=2)

        for layout in ("separate", "joint"):
            eager, compiled = make_caches(2, 10, 4, 8, layout=layout), make_caches(2, 10, 4, 8, layout=layout)
            x = torch.randn(2, 3, 2, 8)
            step(x, *eager, 3)
            torch.compile(step, fullgraph=True)(x, *compiled, 3)
            self.assertTrue(torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1]))


class TestOpcheck(unittest.TestCase):
    def test_opcheck(self):
        for dtype, layout in itertools.product(DTYPES, ("separate", "joint", "head_slice")):
            k_cache, v_cache = make_caches(2, 8, 4, 16, dtype=dtype, layout=layout)
            key = torch.randn(2, 3, 2, 16).to(dtype)
            torch.library.opcheck(torch.ops.kvops.cache_write.default, (key, key, k_cache, v_cache, 2, 1))
            key = torch.randn(2, 3, 4, 16).to(dtype)
            torch.library.opcheck(torch.ops.kvops.cache_write.default, (key, key, k_cache, v_cache, 5, None))
            torch.library.opcheck(torch.ops.kvops.cache_roll.default, (k_cache, v_cache, 3, 1, 4, 1, 2))
            torch.library.opcheck(torch.ops.kvops.cache_roll.default, (k_cache, v_cache, 0, 4, 4, None, None))



class TestSDPALayoutError(expecttest.TestCase):
    def test_heads_and_tokens_swapped(self):
        """A cache in SDPA's layout [B, H, S, D] is named as such, not just "requires cache_head_start"."""
        key = torch.randn(1, 3, 4, 8)
        k_cache, v_cache = torch.zeros(1, 4, 32, 8), torch.zeros(1, 4, 32, 8)
        msg = raises_everywhere(self, ValueError, lambda k, kc, vc: kvops.cache_write(k, k, kc, vc, 0),
                                (key, k_cache, v_cache))
        self.assertExpectedInline(msg, """kvops.cache_write requires cache_head_start when cache heads (32) differ from input heads (4). k_cache of shape (1, 4, 32, 8) has the 4 input heads in dim 1: it looks like SDPA's layout [batch, num_heads, seq_len, head_dim], with heads and tokens swapped. kvops caches are [batch, cache_len, num_kv_heads, head_dim]: pass k_cache.transpose(1, 2) and v_cache.transpose(1, 2) (views of the same memory, no copy).""")
        kvops.cache_write(key, key, k_cache.transpose(1, 2), v_cache.transpose(1, 2), 0)  # the suggested fix
        self.assertTrue(torch.equal(k_cache[:, :, :3], key.transpose(1, 2)))


class TestMoreHeadsThanTheCache(expecttest.TestCase):
    def test_says_no_head_slice_fits(self):
        """3 input heads into a 2-head cache: "requires cache_head_start" alone cannot help, so the message says why."""
        key = torch.randn(1, 2, 3, 8)
        k_cache, v_cache = torch.zeros(1, 16, 2, 8), torch.zeros(1, 16, 2, 8)
        msg = raises_everywhere(self, ValueError, lambda k, kc, vc: kvops.cache_write(k, k, kc, vc, 0),
                                (key, k_cache, v_cache))
        self.assertExpectedInline(msg, """kvops.cache_write requires cache_head_start when cache heads (2) differ from input heads (3). The input carries more heads than the cache holds, so no head slice fits: allocate the cache with 3 KV heads, or pass the key/value of this writer's 2 heads.""")
        self.assertFalse(k_cache.any() or v_cache.any())


if __name__ == "__main__":
    unittest.main()

"""kvops.paged_cache_write: bit-exact against a per-token reference, padding, strided/fp8 caches, contracts, opcheck."""

import itertools
import unittest
import unittest.mock

import expecttest
import torch

import kvops
import kvops.ops.paged_write as paged_write_ops
from tests.contract import OpLog, raises_everywhere

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn
SENTINEL = -7.0
LAYOUTS = ("separate", "joint", "joint_blocks", "head_view")


def make_paged_caches(p, bs, h, d, d_v=None, dtype=torch.float32, layout="separate", device="cpu"):
    """Sentinel-filled ``[P, block_size, H, D]`` caches.

    layout: separate | joint (K/V views of one [P, bs, 2, H, D] allocation: block and row dims mergeable) |
    joint_blocks (views of [P, 2, bs, H, D], as FlashInfer: not mergeable) | head_view (heads [2, 2+H) of a wider one).
    """
    d_v = d if d_v is None else d_v
    fill = lambda shape: torch.full(shape, SENTINEL, device=device).to(dtype)  # noqa: E731  (fp8 has no full())
    if layout == "separate":
        return fill((p, bs, h, d)), fill((p, bs, h, d_v))
    if layout == "joint":
        assert d == d_v
        kv = fill((p, bs, 2, h, d))
        return kv[:, :, 0], kv[:, :, 1]
    if layout == "joint_blocks":
        assert d == d_v
        kv = fill((p, 2, bs, h, d))
        return kv[:, 0], kv[:, 1]
    if layout == "head_view":
        return fill((p, bs, h + 3, d))[:, :, 2 : 2 + h], fill((p, bs, h + 3, d_v))[:, :, 2 : 2 + h]
    raise ValueError(layout)


def ref_quant(x, scale, head):
    """One head of one token to fp8: fp32 divide, saturate to ±448, round to nearest."""
    s = scale[0] if scale.numel() == 1 else scale[head]
    return (x.float() / s).clamp(-448.0, 448.0).to(FP8)


def ref_write(k_cache, v_cache, key, value, slot_mapping, h0=0, k_scale=None, v_scale=None):
    """Plain per-token reference on copies of the caches."""
    k, v = k_cache.clone(), v_cache.clone()
    bs = k.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        for h in range(key.shape[1]):
            for cache, x, scale in ((k, key, k_scale), (v, value, v_scale)):
                row = x[i, h] if scale is None else ref_quant(x[i, h], scale, h0 + h)
                cache[slot // bs, slot % bs, h0 + h] = row
    return k, v


def random_slots(p, bs, n, pad=0, dtype=torch.int64, seed=0):
    """``n`` distinct slots in ``[0, P * bs)`` with ``pad`` entries set to -1 (padding)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(p * bs, generator=g)[:n]
    if pad:
        slots[torch.randperm(n, generator=g)[:pad]] = -1
    return slots.to(dtype)


class TestPagedWrite(expecttest.TestCase):
    def test_matches_reference(self):
        cases = [  # (P, block_size, H_kv, H_in, D, D_v, N, N', pad, cache_head_start)
            (4, 16, 4, 4, 64, 64, 20, 20, 0, None),
            (9, 1, 2, 2, 80, 80, 7, 7, 0, None),  # block_size 1, head_dim 80
            (6, 4, 5, 1, 80, 80, 9, 12, 3, 4),  # GQA 5:1 group: the last of five heads; padded key and slots
            (5, 3, 5, 1, 16, 16, 6, 6, 2, 0),
            (3, 8, 6, 2, 32, 48, 10, 11, 4, 3),  # D_v != D
            (4, 4, 2, 2, 8, 8, 0, 3, 0, None),  # zero tokens (key still has rows)
            (4, 4, 2, 2, 8, 8, 5, 5, 5, None),  # all padding
        ]
        for dtype, case, idx_dtype in itertools.product(DTYPES, cases, (torch.int32, torch.int64)):
            p, bs, hkv, hin, d, dv, n, n_pad, pad, h0 = case
            layouts = LAYOUTS if d == dv else ("separate", "head_view")
            for layout in layouts:
                with self.subTest(dtype=dtype, case=case, idx=idx_dtype, layout=layout):
                    k_cache, v_cache = make_paged_caches(p, bs, hkv, d, dv, dtype, layout)
                    key = torch.randn(n_pad, hin, d).to(dtype)
                    value = torch.randn(n_pad, hin, dv).to(dtype)
                    slots = random_slots(p, bs, n, pad, idx_dtype, seed=n + p)
                    want_k, want_v = ref_write(k_cache, v_cache, key, value, slots, h0 or 0)
                    ptrs = (k_cache.data_ptr(), v_cache.data_ptr())
                    kvops.paged_cache_write(key, value, k_cache, v_cache, slots, cache_head_start=h0)
                    self.assertEqual((k_cache.data_ptr(), v_cache.data_ptr()), ptrs)
                    self.assertTrue(torch.equal(k_cache, want_k))
                    self.assertTrue(torch.equal(v_cache, want_v))

    def test_joint_allocation_written_in_place(self):
        for layout in ("joint", "joint_blocks"):
            k_cache, v_cache = make_paged_caches(3, 4, 2, 8, layout=layout)
            base = k_cache._base
            key, value = torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0)
            kvops.paged_cache_write(key, value, k_cache, v_cache, torch.tensor([5, 10]))
            k_rows = base[:, :, 0] if layout == "joint" else base[:, 0]
            v_rows = base[:, :, 1] if layout == "joint" else base[:, 1]
            self.assertTrue(torch.equal(k_rows[1, 1], key[0]) and torch.equal(k_rows[2, 2], key[1]))
            self.assertTrue(torch.equal(v_rows[1, 1], value[0]) and torch.equal(v_rows[2, 2], value[1]))
            self.assertEqual(int((base != SENTINEL).sum()), 4 * 2 * 8)

    def test_noncontiguous_key(self):
        k_cache, v_cache = make_paged_caches(4, 4, 3, 16)
        key = torch.randn(3, 16, 6).permute(2, 0, 1)  # [N'=6, H=3, D=16] with permuted strides
        value = torch.randn(6, 3, 32)[:, :, ::2]
        slots = torch.tensor([3, -1, 15, 0, 7], dtype=torch.int32)
        want_k, want_v = ref_write(k_cache, v_cache, key, value, slots)
        kvops.paged_cache_write(key, value, k_cache, v_cache, slots)
        self.assertTrue(torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v))

    def test_fp8(self):
        cases = [  # (H_kv, H_in, cache_head_start, scale heads, layout)
            (4, 4, None, 1, "separate"),
            (4, 4, None, 4, "joint"),
            (5, 1, 3, 5, "separate"),  # [H_kv] scales with a head slice: the written head's scale
            (5, 2, 1, 1, "joint_blocks"),
            (3, 3, None, 3, "head_view"),
        ]
        for src_dtype, case in itertools.product(DTYPES, cases):
            hkv, hin, h0, nscale, layout = case
            with self.subTest(src=src_dtype, case=case):
                k_cache, v_cache = make_paged_caches(4, 4, hkv, 16, dtype=FP8, layout=layout)
                key = (torch.randn(7, hin, 16) * 300).to(src_dtype)  # some values saturate (|x / scale| > 448)
                value = (torch.randn(7, hin, 16) * 3).to(src_dtype)
                k_scale = torch.rand(nscale) + 0.25
                v_scale = torch.rand(nscale) * 0.01 + 0.001
                slots = random_slots(4, 4, 6, pad=1, seed=nscale)
                want_k, want_v = ref_write(k_cache, v_cache, key, value, slots, h0 or 0, k_scale, v_scale)
                kvops.paged_cache_write(key, value, k_cache, v_cache, slots, h0, k_scale, v_scale)
                self.assertTrue(torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8)))
                self.assertTrue(torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8)))
                self.assertEqual(float(k_cache.float().abs().max()), 448.0)  # saturated, not NaN/inf

    def test_out_of_range_slot_raises_on_cpu(self):
        k_cache, v_cache = make_paged_caches(2, 4, 2, 8)
        key = torch.randn(2, 2, 8)
        with self.assertRaises(IndexError) as cm, kvops.value_checks("off"):  # the kernel's own check (eager: §7)
            kvops.paged_cache_write(key, key, k_cache, v_cache, torch.tensor([1, 8]))
        self.assertExpectedInline(
            str(cm.exception),
            """kvops.paged_cache_write: slot_mapping holds slot 8 but the cache has only 8 slots (2 blocks x block_size 4); valid slots are [0, 8) or negative (skip).""",
        )
        self.assertTrue(bool((k_cache == SENTINEL).all()))  # nothing written

    def test_check_slot_mapping(self):
        k_cache, _ = make_paged_caches(2, 4, 2, 8)
        kvops.check_slot_mapping(torch.tensor([-1, 0, 7, -1], dtype=torch.int32), k_cache)
        with self.assertRaises(RuntimeError) as cm:  # the eager value check of docs/semantics.md §7
            kvops.check_slot_mapping(torch.tensor([3, 9]), k_cache)
        self.assertExpectedInline(
            str(cm.exception),
            """kvops.paged_cache_write: slot_mapping[1] = 9 is outside the cache: valid slots are [0, 8) (2 blocks x block_size 4), or negative to skip a padding token. Nothing was written. Pass block * block_size + row for a block of the cache (or -1 for padding).""",
        )
        with self.assertRaises(ValueError) as cm:
            kvops.check_slot_mapping(torch.tensor([-1, 2, 5, -1, 2]), k_cache)
        self.assertExpectedInline(
            str(cm.exception),
            """kvops.paged_cache_write: slot 2 appears more than once in slot_mapping; each written token needs its own slot.""",
        )


def _setup(h=4, d=16, dtype=torch.float32):
    k_cache, v_cache = make_paged_caches(3, 4, h, d, dtype=dtype)
    return k_cache, v_cache, torch.tensor([0, 5, -1], dtype=torch.int32)


class TestNativeKernel(expecttest.TestCase):
    """The native CPU kernel (kvops/native/paged_write.cpp, behind the eager fast path and the op's CPU kernel) against
    the composite torch kernel (kvops/cpu/paged_write.py), bit for bit, and the fast path's dispatch rules."""

    def composite(self):
        """The composite kernel, as when no C++ compiler is available."""
        return unittest.mock.patch.object(paged_write_ops.native, "use_native", return_value=False)

    def test_fp8_special_values_match_the_composite_kernel(self):
        """fp8 quantization of NaN, ±inf, ±0, subnormals, round-to-nearest-even ties (e4m3 spacing at 1.0 is 1/8),
        saturation past ±448, from fp32/bf16/fp16 keys; per-head scales with a head slice, a strided key, an HND cache
        and K/V views of one [P, 2, block_size, H, D] allocation."""
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -2.0 ** -10, 2.0 ** -9,
                                 1.0625, 1.1875, -1.3125, 447.9, 448.0, 449.0, 464.0, 480.0, 1e6, -1e6, 3.0e-3, 17.0])
        for src_dtype in DTYPES:
            g = torch.Generator().manual_seed(0)
            x = (torch.randn(9, 3, 2, 20, generator=g) * 100).to(src_dtype)
            x[:, 0, 0] = specials.to(src_dtype)
            key, value = x[:, 0].transpose(1, 2).contiguous().transpose(1, 2), x[:, 1]  # key [9, 20, 2]^T: strided
            for layout, kv_layout in (("separate", "NHD"), ("joint_blocks", "NHD"), ("hnd", "HND")):
                with self.subTest(src=src_dtype, layout=layout):
                    if layout == "hnd":
                        k_cache = torch.zeros(3, 4, 4, 20).to(FP8)
                        v_cache = torch.zeros(3, 4, 4, 20).to(FP8)
                    else:
                        k_cache, v_cache = make_paged_caches(3, 4, 4, 20, dtype=FP8, layout=layout)
                    k_scale, v_scale = torch.tensor([0.5, 2.0, 0.25, 1.0]), torch.tensor([1.0, 1.0, 3.0, 0.125])
                    slots = torch.tensor([5, -1, 0, 11, 7, -1, 2, 9, 1], dtype=torch.int32)
                    args = (slots, 1, k_scale, v_scale, kv_layout)
                    want_k, want_v = k_cache.clone(), v_cache.clone()
                    with self.composite():
                        kvops.paged_cache_write(key, value, want_k, want_v, *args)
                    kvops.paged_cache_write(key, value, k_cache, v_cache, *args)
                    self.assertTrue(torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8)))
                    self.assertTrue(torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8)))

    def test_validation_is_memoized_but_errors_are_not(self):
        k_cache, v_cache = make_paged_caches(2, 4, 2, 8)
        key, slots = torch.randn(3, 2, 8), torch.tensor([0, 5, -1])
        with unittest.mock.patch.object(paged_write_ops, "check_paged_cache_write",
                                        wraps=paged_write_ops.check_paged_cache_write) as validator:
            paged_write_ops._memo.clear()
            for _ in range(3):
                kvops.paged_cache_write(key, key, k_cache, v_cache, slots)
            self.assertEqual(validator.call_count, 1)
            expanded = torch.zeros(1, 4, 2, 8).expand(2, 4, 2, 8)  # same shape and dtype, stride 0: an error
            for _ in range(2):
                with self.assertRaisesRegex(ValueError, "stride 0 in dim 0"):
                    kvops.paged_cache_write(key, key, expanded, v_cache, slots)
        self.assertEqual(validator.call_count, 3)
        want_k, _ = ref_write(make_paged_caches(2, 4, 2, 8)[0], v_cache, key, key, slots)
        self.assertTrue(torch.equal(k_cache, want_k))

    def test_modes_and_transforms_still_see_the_op(self):
        """The fast path is for plain eager CPU calls only: a TorchDispatchMode sees kvops.paged_cache_write, and a
        plain call bumps the caches' version counters as an in-place op."""
        k_cache, v_cache = make_paged_caches(2, 4, 2, 8)
        key, slots = torch.randn(3, 2, 8), torch.tensor([0, 5, -1])
        with OpLog() as log:
            kvops.paged_cache_write(key, key, k_cache, v_cache, slots)
        self.assertIn("kvops.paged_cache_write.default", log.ops)
        before = (k_cache._version, v_cache._version)
        kvops.paged_cache_write(key, key, k_cache, v_cache, slots)
        self.assertEqual((k_cache._version, v_cache._version), (before[0] + 1, before[1] + 1))


class TestContracts(expecttest.TestCase):
    """Every documented error: same type and message in eager, torch.compile(fullgraph=True) and torch.export."""

    def check(self, fn, *args, exc=ValueError):
        return raises_everywhere(self, exc, fn, args)

    def test_missing_v_cache_and_value(self):
        kc, vc, slots = _setup()
        key = torch.randn(3, 4, 16)
        msg = self.check(lambda k, kc, s: kvops.paged_cache_write(k, k, kc, None, s), key, kc, slots)
        self.assertExpectedInline(msg, """kvops.paged_cache_write: v_cache must be provided (the V cache written or read with k_cache).""")
        msg = self.check(lambda k, kc, vc, s: kvops.paged_cache_write(k, None, kc, vc, s), key, kc, vc, slots)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: value must be provided (got value=None with a v_cache); pass value [N, H_in, D_v].""",
        )

    def test_slot_mapping_dtype_and_rank(self):
        kc, vc, slots = _setup()
        key = torch.randn(3, 4, 16)
        f = lambda k, kc, vc, s: kvops.paged_cache_write(k, k, kc, vc, s)  # noqa: E731
        msg = self.check(f, key, kc, vc, slots.float())
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: slot_mapping must be a 1-D int32 or int64 tensor [num_tokens], got shape (3,) and dtype torch.float32. Pass slot_mapping.to(torch.int64) (built with integer ops: // rather than /).""",
        )
        msg = self.check(f, key, kc, vc, slots.view(1, 3))
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: slot_mapping must be a 1-D int32 or int64 tensor [num_tokens], got shape (1, 3) and dtype torch.int32. Reshape slot_mapping to [num_tokens].""",
        )

    def test_key_shorter_than_slot_mapping(self):
        kc, vc, slots = _setup()
        key = torch.randn(2, 4, 16)
        msg = self.check(lambda k, kc, vc, s: kvops.paged_cache_write(k, k, kc, vc, s), key, kc, vc, slots)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: key has 2 tokens but slot_mapping has 3; key and value need at least one row per slot (extra rows are ignored). Pad key/value or trim slot_mapping.""",
        )

    def test_heads(self):
        kc, vc, slots = _setup(h=5)
        key = torch.randn(3, 1, 16)
        msg = self.check(lambda k, kc, vc, s: kvops.paged_cache_write(k, k, kc, vc, s), key, kc, vc, slots)
        self.assertExpectedInline(
            msg, """kvops.paged_cache_write requires cache_head_start when cache heads (5) differ from input heads (1). If the model has 1 KV head, allocate the cache with 1 KV head (num_kv_heads=1). A head slice is for several writers filling one cache (tensor-parallel writers): then pass cache_head_start (0 <= cache_head_start <= 4) to write the input heads as heads [cache_head_start, cache_head_start + 1), and have the other writers fill the other heads before attention. Or pass key/value with all 5 heads."""
        )
        msg = self.check(lambda k, kc, vc, s: kvops.paged_cache_write(k, k, kc, vc, s, 5), key, kc, vc, slots)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: head slice [5, 6) is outside the cache's heads [0, 5). Pass 0 <= cache_head_start <= 4 for 1 input heads.""",
        )

    def test_head_dim_dtype_device(self):
        kc, vc, slots = _setup()
        f = lambda k, kc, vc, s: kvops.paged_cache_write(k, k, kc, vc, s)  # noqa: E731
        msg = self.check(f, torch.randn(3, 4, 8), kc, vc, slots)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: head_dim mismatch: key has shape (3, 4, 8) (head_dim 8) but k_cache has shape (3, 4, 4, 16) (head_dim 16).""",
        )
        msg = self.check(f, torch.randn(3, 4, 16, dtype=torch.bfloat16), kc, vc, slots)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: key dtype torch.bfloat16 does not match k_cache dtype torch.float32. Cast key to torch.float32.""",
        )
        msg = self.check(f, torch.randn(3, 4, 16), kc, vc, slots.to("meta"))
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: slot_mapping is on meta but k_cache is on cpu. Move both to the same device.""",
        )

    def test_key_value_and_cache_mismatch(self):
        kc, vc, slots = _setup()
        key = torch.randn(3, 4, 16)
        f = lambda k, v, kc, vc, s: kvops.paged_cache_write(k, v, kc, vc, s)  # noqa: E731
        msg = self.check(f, key, torch.randn(4, 4, 16), kc, vc, slots)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: key shape (3, 4, 16) and value shape (4, 4, 16) must agree in [num_tokens, num_heads].""",
        )
        msg = self.check(f, key, key, kc, torch.zeros(3, 8, 4, 16), slots)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: k_cache shape (3, 4, 4, 16) and v_cache shape (3, 8, 4, 16) must agree in [num_blocks, block_size, num_kv_heads]; only head_dim may differ.""",
        )
        msg = self.check(f, key, key, kc, vc.half(), slots)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: v_cache dtype torch.float16 does not match k_cache dtype torch.float32. Cast v_cache to torch.float32.""",
        )

    def test_ranks(self):
        kc, vc, slots = _setup()
        f = lambda k, kc, vc, s: kvops.paged_cache_write(k, k, kc, vc, s)  # noqa: E731
        msg = self.check(f, torch.randn(1, 3, 4, 16), kc, vc, slots)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: key must be 3-D [num_tokens, num_heads, head_dim], got shape (1, 3, 4, 16). Reshape key to [num_tokens, num_heads, head_dim].""",
        )
        msg = self.check(f, torch.randn(3, 4, 16), kc.flatten(0, 1), vc.flatten(0, 1), slots)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: k_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], got shape (12, 4, 16). Reshape k_cache to [num_blocks, block_size, num_kv_heads, head_dim].""",
        )

    def test_expanded_cache_cannot_be_written_in_place(self):
        kc, vc, slots = _setup()
        f = lambda k, kc, vc, s: kvops.paged_cache_write(k, k, kc, vc, s)  # noqa: E731
        msg = self.check(f, torch.randn(3, 4, 16), kc, vc[:1].expand_as(vc), slots)
        self.assertExpectedInline(msg, """kvops.paged_cache_write: v_cache of shape (3, 4, 4, 16) has stride 0 in dim 0 (an expanded view): its elements share memory, so it cannot be written in place. Allocate the cache with its own storage (e.g. torch.zeros, or .clone() the expanded view once).""")

    def test_fp8_scales(self):
        kc, vc, slots = _setup(dtype=FP8)
        key = torch.randn(3, 4, 16)
        one = torch.ones(1)
        f = lambda k, kc, vc, s, *sc: kvops.paged_cache_write(k, k, kc, vc, s, None, *sc)  # noqa: E731
        msg = self.check(f, key, kc, vc, slots)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: a torch.float8_e4m3fn cache needs k_scale and v_scale (float32, shape [1] or [4]); the cache holds x / scale. Pass both scales.""",
        )
        msg = self.check(f, key, kc, vc, slots, one)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: a torch.float8_e4m3fn cache needs k_scale and v_scale (float32, shape [1] or [4]); the cache holds x / scale. Pass both scales.""",
        )
        msg = self.check(f, key, kc, vc, slots, one, torch.ones(3))
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: v_scale must be a float32 tensor of shape [1] (per tensor) or [4] (per KV head of the cache), got shape (3,) and dtype torch.float32.""",
        )
        msg = self.check(f, key, kc, vc, slots, torch.ones(1, 1), one)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: k_scale must be a float32 tensor of shape [1] (per tensor) or [4] (per KV head of the cache), got shape (1, 1) and dtype torch.float32.""",
        )
        msg = self.check(f, key, kc, vc, slots, one.half(), one)
        self.assertExpectedInline(
            msg, """kvops.paged_cache_write: k_scale must be a float32 tensor of shape [1] (per tensor) or [4] (per KV head of the cache), got shape (1,) and dtype torch.float16."""
        )
        msg = self.check(f, key.to(FP8), kc, vc, slots, one, one)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: key dtype torch.float8_e4m3fn cannot be quantized into a torch.float8_e4m3fn k_cache; pass key as float32, bfloat16 or float16.""",
        )
        kc, vc, slots = _setup()
        msg = self.check(f, key, kc, vc, slots, one, one)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: k_scale/v_scale were given but the cache dtype is torch.float32; scales apply only to torch.float8_e4m3fn caches. Drop the scales or allocate the caches as torch.float8_e4m3fn.""",
        )


class TestCompile(expecttest.TestCase):
    def test_compiled_equals_eager_with_padding(self):
        def step(x, kc, vc, slots):
            kvops.paged_cache_write(x * 2, -x, kc, vc, slots, cache_head_start=1)

        for layout in ("separate", "joint_blocks"):
            torch._dynamo.reset()
            eager = make_paged_caches(4, 4, 4, 8, layout=layout)
            compiled = make_paged_caches(4, 4, 4, 8, layout=layout)
            x = torch.randn(6, 2, 8)
            slots = torch.tensor([3, -1, 12, 0, -1], dtype=torch.int32)
            step(x, *eager, slots)
            torch.compile(step, fullgraph=True)(x, *compiled, slots)
            self.assertTrue(torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1]))
            self.assertEqual(int((eager[0] != SENTINEL).sum()), 3 * 2 * 8)

    def test_token_count_is_dynamic(self):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        kc, vc = make_paged_caches(8, 4, 2, 8)
        f = torch.compile(lambda k, kc, vc, s: kvops.paged_cache_write(k, k, kc, vc, s), fullgraph=True,
                          backend="aot_eager")
        for n in range(1, 8):
            f(torch.randn(n, 2, 8), kc, vc, torch.arange(n) * 3)
        self.assertLessEqual(torch._dynamo.utils.counters["stats"]["unique_graphs"], 2)


class TestOpcheck(unittest.TestCase):
    def test_opcheck(self):
        op = torch.ops.kvops.paged_cache_write.default
        for dtype, layout in itertools.product(DTYPES, LAYOUTS):
            k_cache, v_cache = make_paged_caches(3, 4, 4, 16, dtype=dtype, layout=layout)
            slots = torch.tensor([5, -1, 11, 0], dtype=torch.int32)
            key = torch.randn(5, 2, 16).to(dtype)
            torch.library.opcheck(op, (key, key, k_cache, v_cache, slots, 1, None, None))
            key = torch.randn(4, 4, 16).to(dtype)
            torch.library.opcheck(op, (key, key * 2, k_cache, v_cache, slots.long(), None, None, None))

    def test_opcheck_fp8(self):
        op = torch.ops.kvops.paged_cache_write.default
        k_cache, v_cache = make_paged_caches(3, 4, 4, 16, dtype=FP8, layout="joint")
        key = torch.randn(4, 2, 16, dtype=torch.bfloat16)
        slots = torch.tensor([5, -1, 11, 0])
        args = (key, key, k_cache, v_cache, slots, 2, torch.full((4,), 0.5), torch.ones(1))
        # test_schema is left out: it multiplies the arguments, and torch has no fp8 mul on CPU.
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(op, args, test_utils=utils)


if __name__ == "__main__":
    unittest.main()

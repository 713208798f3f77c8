"""kvops.paged_kv_gather / kvops.paged_kv_scatter: bit-exact against a per-token reference, guard bands untouched,
opcheck, and every contract error through raises_everywhere (eager, compile, export)."""

import itertools
import unittest

import expecttest
import torch

import kvops
from kvops.ops.transfer import staging_shape
from tests.contract import raises_everywhere

FP8 = torch.float8_e4m3fn
LAYOUTS = ("separate", "joint", "joint_blocks", "head_view")


def make_layers(num_layers, p, bs, h, d, dtype, layout, seed=0):
    """``num_layers`` K and V caches ``[P, bs, H, D]`` of random values (each layer its own allocation).

    layout: separate | joint (views of [P, bs, 2, H, D]) | joint_blocks (views of [P, 2, bs, H, D]: block and row
    dims not mergeable) | head_view (heads [2, 2 + H) of a wider cache).
    """
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 3).to(dtype)  # noqa: E731
    ks, vs = [], []
    for _ in range(num_layers):
        if layout == "separate":
            k, v = rand(p, bs, h, d), rand(p, bs, h, d)
        elif layout == "joint":
            kv = rand(p, bs, 2, h, d)
            k, v = kv[:, :, 0], kv[:, :, 1]
        elif layout == "joint_blocks":
            kv = rand(p, 2, bs, h, d)
            k, v = kv[:, 0], kv[:, 1]
        else:
            k, v = rand(p, bs, h + 3, d)[:, :, 2 : 2 + h], rand(p, bs, h + 3, d)[:, :, 2 : 2 + h]
        ks.append(k)
        vs.append(v)
    return ks, vs


def bits(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


def ref_gather(ks, vs, table, start, h0, n, h):
    """Per-token reference: ``[2, L, n, h, D]``."""
    bs = ks[0].shape[1]
    out = torch.empty(2, len(ks), n, h, ks[0].shape[3], dtype=ks[0].dtype)
    for kv, caches in enumerate((ks, vs)):
        for layer, c in enumerate(caches):
            for i in range(n):
                p = start + i
                out[kv, layer, i] = c[int(table[p // bs]), p % bs, h0 : h0 + h]
    return out


def ref_scatter(staging, ks, vs, table, start, h0):
    bs = ks[0].shape[1]
    for kv, caches in enumerate((ks, vs)):
        for layer, c in enumerate(caches):
            for i in range(staging.shape[2]):
                p = start + i
                c[int(table[p // bs]), p % bs, h0 : h0 + staging.shape[3]] = staging[kv, layer, i]


class TestRoundTrip(expecttest.TestCase):
    def check(self, dtype, layout, num_layers=2, p=9, bs=4, h_src=4, h_dst=6, d=8, n=7, start=3, h0=1, dst_h0=3,
              idx=torch.int32):
        ks, vs = make_layers(num_layers, p, bs, h_src, d, dtype, layout, seed=1)
        nb = -(-(start + n) // bs)
        src_table = torch.randperm(p, generator=torch.Generator().manual_seed(2))[:nb].to(idx)
        dst_table = torch.randperm(p, generator=torch.Generator().manual_seed(3))[:nb].to(idx)
        h = min(h_src - h0, h_dst - dst_h0)
        staging = torch.empty(staging_shape(num_layers, n, h, d), dtype=dtype)
        before = [c.clone() for c in ks + vs]
        kvops.paged_kv_gather(ks, vs, src_table, staging, start, h0)
        self.assertTrue(torch.equal(bits(staging), bits(ref_gather(ks, vs, src_table, start, h0, n, h))))
        self.assertTrue(all(torch.equal(bits(a), bits(b)) for a, b in zip(ks + vs, before)))  # only read
        # scatter into a decode-side cache with its own table and head start; every other element keeps its value
        dks, dvs = make_layers(num_layers, p, bs, h_dst, d, dtype, layout, seed=4)
        want_k, want_v = [c.clone() for c in dks], [c.clone() for c in dvs]
        ref_scatter(staging, want_k, want_v, dst_table, start, dst_h0)
        kvops.paged_kv_scatter(staging, dks, dvs, dst_table, start, dst_h0)
        for got, want in zip(dks + dvs, want_k + want_v):
            self.assertTrue(torch.equal(bits(got), bits(want)))
        back = torch.empty_like(staging)
        kvops.paged_kv_gather(dks, dvs, dst_table, back, start, dst_h0)
        self.assertTrue(torch.equal(bits(back), bits(staging)))

    def test_dtypes_and_layouts(self):
        for dtype, layout in itertools.product((torch.float32, torch.bfloat16, torch.float16, FP8), LAYOUTS):
            with self.subTest(dtype=dtype, layout=layout):
                self.check(dtype, layout)

    def test_odd_shapes(self):
        self.check(torch.bfloat16, "separate", d=80, h_src=5, h_dst=7, h0=0, dst_h0=2)  # head_dim 80
        self.check(torch.float32, "joint", bs=1, n=5, start=0, idx=torch.int64)  # block_size 1, int64 table
        self.check(torch.float32, "separate", num_layers=1, n=0)  # zero tokens
        self.check(torch.float16, "joint_blocks", num_layers=3, bs=16, p=3, n=20, start=11)  # crosses blocks

    def test_block_id_out_of_range(self):
        ks, vs = make_layers(1, 4, 2, 2, 8, torch.float32, "separate")
        staging = torch.empty(staging_shape(1, 3, 2, 8))
        with self.assertRaises(IndexError) as cm:
            kvops.paged_kv_gather(ks, vs, torch.tensor([1, 4], dtype=torch.int32), staging)
        self.assertExpectedInline(str(cm.exception), """kvops.paged_kv_gather: block_table holds block 4 but the caches have 4 blocks; valid block ids are [0, 4).""")  # noqa: B950

    def test_opcheck(self):
        for dtype, layout in itertools.product((torch.float32, torch.bfloat16), ("separate", "joint_blocks")):
            ks, vs = make_layers(2, 6, 4, 4, 8, dtype, layout)
            table = torch.tensor([4, 1, 3], dtype=torch.int32)
            staging = torch.empty(staging_shape(2, 5, 2, 8), dtype=dtype)
            torch.library.opcheck(torch.ops.kvops.paged_kv_gather.default, (ks + vs, table, staging, 2, 1))
            torch.library.opcheck(torch.ops.kvops.paged_kv_scatter.default, (staging, ks + vs, table, 2, 2))

    def test_compiled_segments_bit_exact(self):
        # a compiled writer moving grid segments with a dynamic start: same bits as eager, caches mutated in place
        ks, vs = make_layers(2, 8, 4, 2, 8, torch.bfloat16, "joint")
        dks, dvs = make_layers(2, 8, 4, 2, 8, torch.bfloat16, "separate", seed=5)
        src, dst = torch.tensor([6, 0, 3, 5], dtype=torch.int32), torch.tensor([2, 7, 1, 4], dtype=torch.int32)
        want_k, want_v = [c.clone() for c in dks], [c.clone() for c in dvs]

        def move(ks, vs, dks, dvs, src, dst, start, staging):
            kvops.paged_kv_gather(ks, vs, src, staging, start, 0)
            kvops.paged_kv_scatter(staging, dks, dvs, dst, start, 0)

        compiled = torch.compile(move, fullgraph=True, backend="eager")
        for start in (0, 8):
            staging = torch.empty(staging_shape(2, 8, 2, 8), dtype=torch.bfloat16)
            compiled(ks, vs, dks, dvs, src, dst, start, staging)
            ref_scatter(ref_gather(ks, vs, src, start, 0, 8, 2), want_k, want_v, dst, start, 0)
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(dks + dvs, want_k + want_v)))


class TestContracts(expecttest.TestCase):
    def setUp(self):
        self.ks, self.vs = make_layers(2, 6, 4, 4, 8, torch.float32, "separate")
        self.table = torch.tensor([4, 1], dtype=torch.int32)
        self.staging = torch.empty(staging_shape(2, 5, 2, 8))

    def gather(self, ks=None, vs=None, table=None, staging=None, start=0, h0=0):
        args = (ks or self.ks, vs or self.vs, self.table if table is None else table,
                self.staging if staging is None else staging)
        return raises_everywhere(self, ValueError, lambda k, v, t, s: kvops.paged_kv_gather(k, v, t, s, start, h0),
                                 args)

    def test_cache_list(self):
        self.assertExpectedInline(self.gather(vs=self.vs[:1]), """kvops.paged_kv_gather: caches must hold the K caches of all layers then their V caches (2 * num_layers tensors), got 3 tensors. Pass k_caches and v_caches of equal length >= 1.""")  # noqa: B950
        self.assertExpectedInline(self.gather(vs=[self.vs[0], self.vs[1][:, :, :2]]), """kvops.paged_kv_gather: caches[3] (shape (6, 4, 2, 8), torch.float32, cpu) differs from caches[0] (shape (6, 4, 4, 8), torch.float32, cpu); every layer's K and V cache must have one shape [P, block_size, H_kv, D] (V head_dim equal to K's), dtype and device.""")  # noqa: B950
        self.assertExpectedInline(self.gather(ks=[self.ks[0][0], self.ks[1][0]]), """kvops.paged_kv_gather: caches[0] must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], got shape (4, 4, 8). Reshape caches[0] to [num_blocks, block_size, num_kv_heads, head_dim].""")  # noqa: B950

    def test_block_table(self):
        self.assertExpectedInline(self.gather(table=self.table.float()), """kvops.paged_kv_gather: block_table must be the request's 1-D int32 or int64 row [num_blocks_of_request], got shape (2,) and dtype torch.float32. Pass block_table.to(torch.int32) (built with integer ops: // rather than /).""")  # noqa: B950
        self.assertExpectedInline(self.gather(table=self.table[:1]), """kvops.paged_kv_gather: tokens [0, 5) exceed the request's block_table capacity of 1 blocks x block_size 4 = 4 tokens. Pass a block_table covering start + num_tokens tokens.""")  # noqa: B950
        self.assertExpectedInline(self.gather(start=4), """kvops.paged_kv_gather: tokens [4, 9) exceed the request's block_table capacity of 2 blocks x block_size 4 = 8 tokens. Pass a block_table covering start + num_tokens tokens.""")  # noqa: B950
        self.assertExpectedInline(self.gather(start=-1), """kvops.paged_kv_gather: start must be >= 0 (a token position in the request), got -1.""")  # noqa: B950

    def test_staging(self):
        self.assertExpectedInline(self.gather(staging=torch.empty(2, 3, 5, 2, 8)), """kvops.paged_kv_gather: staging shape (2, 3, 5, 2, 8) must be [2, num_layers=2, num_tokens, num_heads, head_dim=8] ([2, num_layers, num_tokens, num_heads, head_dim]: K layers then V layers).""")  # noqa: B950
        self.assertExpectedInline(self.gather(staging=torch.empty(2, 2, 5, 8, 2).transpose(3, 4)), """kvops.paged_kv_gather: staging of shape (2, 2, 5, 2, 8) and strides (160, 80, 16, 1, 2) is not contiguous; it is sent as one buffer. Allocate it with torch.empty(shape) (or a contiguous slice of a larger buffer).""")  # noqa: B950
        self.assertExpectedInline(self.gather(staging=self.staging.half()), """kvops.paged_kv_gather: staging dtype torch.float16 does not match the caches' dtype torch.float32; the transfer moves bits unchanged. Allocate staging as torch.float32.""")  # noqa: B950
        self.assertExpectedInline(self.gather(h0=3), """kvops.paged_kv_gather: head slice [3, 5) is outside the caches' heads [0, 4). Pass 0 <= cache_head_start <= 2 for 2 staged heads.""")  # noqa: B950

    def test_scatter(self):
        expanded = [torch.zeros(6, 1, 4, 8).expand(6, 4, 4, 8)] + self.ks[1:]
        msg = raises_everywhere(self, ValueError, lambda s, k, v, t: kvops.paged_kv_scatter(s, k, v, t, 0, 0),
                                (self.staging, expanded, self.vs, self.table))
        self.assertExpectedInline(msg, """kvops.paged_kv_scatter: caches[0] of shape (6, 4, 4, 8) has stride 0 in dim 1 (an expanded view): its elements share memory, so it cannot be written in place. Allocate the cache with its own storage (e.g. torch.zeros, or .clone() the expanded view once).""")  # noqa: B950
        msg = raises_everywhere(self, ValueError, lambda s, k, v, t: kvops.paged_kv_scatter(s, k, v, t, 0, 4),
                                (self.staging, self.ks, self.vs, self.table))
        self.assertExpectedInline(msg, """kvops.paged_kv_scatter: head slice [4, 6) is outside the caches' heads [0, 4). Pass 0 <= cache_head_start <= 2 for 2 staged heads.""")  # noqa: B950

    def test_staging_sharing_memory_with_a_cache(self):
        # staging carved out of the same allocation as layer 1's K cache: rejected before layer 0 is written, the
        # message naming both tensors (today: layer 0 written, then torch's "refer to a single memory location")
        arena = torch.randn(2 * 5 * 2 * 8 * 2 + 6 * 4 * 4 * 8)
        ks = [self.ks[0].clone(), arena[100 : 100 + 6 * 4 * 4 * 8].view(6, 4, 4, 8)]
        staging = arena[: 2 * 2 * 5 * 2 * 8].view(staging_shape(2, 5, 2, 8))
        before = [c.clone() for c in ks + self.vs] + [arena.clone()]
        msg = raises_everywhere(self, ValueError, lambda k, v, t, s: kvops.paged_kv_gather(k, v, t, s, 0, 0),
                                (ks, self.vs, self.table, staging))
        self.assertExpectedInline(msg, """kvops.paged_kv_gather: staging (shape (2, 2, 5, 2, 8)) and caches[1] (the K cache of layer 1, shape (6, 4, 4, 8)) share memory: the gather would overwrite the cache it reads. Allocate staging as its own buffer (torch.empty([2, 2, 5, 2, 8], dtype=torch.float32)).""")  # noqa: B950
        vs = [self.vs[0], arena[-6 * 4 * 4 * 8 :].view(6, 4, 4, 8)]  # V of layer 1 over the staging's tail
        staging = arena[-6 * 4 * 4 * 8 - 100 : -6 * 4 * 4 * 8 + 220].view(staging_shape(2, 5, 2, 8))
        msg = raises_everywhere(self, ValueError, lambda s, k, v, t: kvops.paged_kv_scatter(s, k, v, t, 0, 0),
                                (staging, [self.ks[0], ks[0]], vs, self.table))
        self.assertExpectedInline(msg, """kvops.paged_kv_scatter: staging (shape (2, 2, 5, 2, 8)) and caches[3] (the V cache of layer 1, shape (6, 4, 4, 8)) share memory: the scatter would overwrite the staging buffer it reads. Allocate staging as its own buffer (torch.empty([2, 2, 5, 2, 8], dtype=torch.float32)).""")  # noqa: B950
        after = [c for c in ks + self.vs] + [arena]
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(before, after)))  # nothing written
        # adjacent (not overlapping) views of one allocation are fine
        arena = torch.zeros(320 + 768)
        staging, k1 = arena[:320].view(staging_shape(2, 5, 2, 8)), arena[320:].view(6, 4, 4, 8)
        kvops.paged_kv_gather([self.ks[0], k1], self.vs, self.table, staging, 0, 0)


if __name__ == "__main__":
    unittest.main()

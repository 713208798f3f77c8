"""Contract fuzzing of every op (hypothesis, derandomized, bounded).

Each example is a valid call or a valid call with one contract broken (a wrong dtype, shape, head slice, position,
slot mapping, block table, scale, ...). Caches are strided views into larger buffers whose guard rows, heads and
blocks surround the target, and every buffer is compared bit for bit after every call:

- valid: the result equals a plain reference (writes: the same buffer edit done with slicing; attention: an fp64 loop
  per query, within per-dtype tolerance) and nothing outside the target changed;
- invalid: eager raises the documented exception type with the documented wording and nothing changed (never a crash
  in a kernel, never a silent write); the first call of each kind of violation per op is also checked under
  ``torch.compile(fullgraph=True)`` and ``torch.export`` through ``tests/contract.py:raises_everywhere``.

``CALLS`` counts the calls tried per op (printed by ``python -m pytest tests/errors/test_fuzz.py -s``).
"""

from __future__ import annotations

import unittest
from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvops
from kvops.custom_mask import mask_indptr, segment_packbits
from kvops.reference.attention import reference  # the oracle (fp64)
from tests.contract import raises_everywhere

FP8 = torch.float8_e4m3fn
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CALLS: Counter = Counter()
SEEN: set = set()
VALID_EXAMPLES, INVALID_EXAMPLES = 80, 8  # per op: valid calls, and calls per kind of violation


def fuzz(test, strategy, kinds, body):
    """Run ``body(case)`` on ``VALID_EXAMPLES`` valid cases and ``INVALID_EXAMPLES`` cases of every violation."""
    for kind in (None, *kinds):
        examples = VALID_EXAMPLES if kind is None else INVALID_EXAMPLES
        given(strategy(kind))(settings(derandomize=True, max_examples=examples, deadline=None, database=None)(
            lambda self, c: body(c)))(test)


def rand(shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(dtype)


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """Same-size integer view: bit-exact comparison, NaN included."""
    return t.view(_INT[t.element_size()]) if t.is_floating_point() else t


def same(a, b) -> bool:
    return torch.equal(bits(a), bits(b))


class FuzzCase(unittest.TestCase):
    def run_call(self, op: str, kind, fn, tensors, buffers, expected_buffers=None, error=None, check=None):
        """Call ``fn(*tensors)``; ``kind`` None for a valid call, else the violation (``error = (type, wording)``)."""
        CALLS[f"{op} valid" if kind is None else f"{op} invalid"] += 1
        before = [b.clone() for b in buffers]
        if kind is None:
            result = fn(*tensors)
            for got, want in zip(buffers, expected_buffers or before):
                self.assertTrue(same(got, want), f"{op}: wrong write or guard changed")
            if check is not None:
                check(result)
            return
        exc_type, wording = error
        with self.assertRaises(exc_type) as cm:
            fn(*tensors)
        self.assertIs(type(cm.exception), exc_type)
        self.assertIn(wording, str(cm.exception), (op, kind))
        for got, want in zip(buffers, before):
            self.assertTrue(same(got, want), f"{op}/{kind}: an invalid call wrote")
        if (op, kind) not in SEEN:
            SEEN.add((op, kind))
            CALLS[op + " (compile+export)"] += 1
            self.assertEqual(raises_everywhere(self, exc_type, fn, tensors), str(cm.exception))


# --- contiguous: cache_write / cache_roll ------------------------------------------------------------------------
WRITE_BAD = ["dtype", "head_dim", "batch", "rank", "no_head_start", "head_slice", "range", "v_none", "expanded"]
ROLL_BAD = ["range", "negative", "num_heads", "head_slice", "v_none"]


@st.composite
def contiguous_cases(draw, kind):
    b, s, h = draw(st.integers(1, 2)), draw(st.integers(1, 9)), draw(st.integers(1, 5))
    d = draw(st.sampled_from([1, 4, 80]))
    d_v = draw(st.sampled_from([d, 3]))
    h_in = draw(st.integers(1, h))
    h0 = draw(st.integers(0, h - h_in))
    t = draw(st.integers(0, s))
    return dict(b=b, s=s, h=h, d=d, d_v=d_v, h_in=h_in, h0=h0, t=t, start=draw(st.integers(0, s - t)),
                src=draw(st.integers(0, s - t)), dst=draw(st.integers(0, s - t)), dtype=draw(st.sampled_from(DTYPES)),
                explicit_head=draw(st.booleans()), seed=draw(st.integers(0, 2**16)), kind=kind)


def contiguous_buffers(c, gen):
    """K/V caches as views ``base[:, 1:S+1, 1:H+1]`` of buffers with a guard row/head on each side; with
    ``D_v == D`` on odd seeds K and V are views of one ``[B, S + 2, 2, H + 2, D]`` allocation (joint K/V)."""
    if c["d_v"] == c["d"] and c["seed"] % 2:
        kv = rand((c["b"], c["s"] + 2, 2, c["h"] + 2, c["d"]), c["dtype"], gen)
        kb, vb = kv[:, :, 0], kv[:, :, 1]
    else:
        kb = rand((c["b"], c["s"] + 2, c["h"] + 2, c["d"]), c["dtype"], gen)
        vb = rand((c["b"], c["s"] + 2, c["h"] + 2, c["d_v"]), c["dtype"], gen)
    return kb, vb, kb[:, 1:-1, 1:-1], vb[:, 1:-1, 1:-1]


class TestFuzzContiguous(FuzzCase):
    def test_cache_write(self):
        fuzz(self, contiguous_cases, WRITE_BAD, self.cache_write)

    def cache_write(self, c):
        gen = torch.Generator().manual_seed(c["seed"])
        kb, vb, k_cache, v_cache = contiguous_buffers(c, gen)
        key = rand((c["b"], c["t"], c["h_in"], c["d"]), c["dtype"], gen)
        value = rand((c["b"], c["t"], c["h_in"], c["d_v"]), c["dtype"], gen)
        start, h0 = c["start"], c["h0"] if (c["h_in"] != c["h"] or c["explicit_head"]) else None
        kind, error = c["kind"], None
        if kind == "dtype":
            key, error = key.double(), (ValueError, "key dtype torch.float64 does not match k_cache dtype")
        elif kind == "head_dim":
            key, error = rand((c["b"], c["t"], c["h_in"], c["d"] + 1), c["dtype"], gen), (ValueError,
                                                                                            "head_dim mismatch")
        elif kind == "batch":
            key = rand((c["b"] + 1, c["t"], c["h_in"], c["d"]), c["dtype"], gen)
            value = rand((c["b"] + 1, c["t"], c["h_in"], c["d_v"]), c["dtype"], gen)
            error = (ValueError, "batch mismatch")
        elif kind == "rank":
            key, error = key[0], (ValueError, "key must be 4-D")
        elif kind == "no_head_start":
            key = rand((c["b"], c["t"], c["h"] + 1, c["d"]), c["dtype"], gen)
            value = rand((c["b"], c["t"], c["h"] + 1, c["d_v"]), c["dtype"], gen)
            h0, error = None, (ValueError, "requires cache_head_start when cache heads")
        elif kind == "head_slice":
            h0, error = c["h"] - c["h_in"] + 1, (ValueError, "is outside the cache's heads")
        elif kind == "range":
            start, error = c["s"] - c["t"] + 1, (RuntimeError, "Invalid kvops.cache_write write range")
        elif kind == "v_none":
            v_cache, error = None, (ValueError, "v_cache must be provided")
        elif kind == "expanded":
            k_cache = k_cache[:, :1].expand(c["b"], max(2, c["s"]), c["h"], c["d"])
            v_cache = v_cache[:, :1].expand(c["b"], max(2, c["s"]), c["h"], c["d_v"])
            key, value, start, error = key[:, :0], value[:, :0], 0, (ValueError, "stride 0 in dim 1")
        expected = None
        if kind is None:
            ek, ev = kb.clone(), vb.clone()
            first = h0 or 0
            ek[:, 1 + start : 1 + start + c["t"], 1 + first : 1 + first + c["h_in"]] = key
            ev[:, 1 + start : 1 + start + c["t"], 1 + first : 1 + first + c["h_in"]] = value
            expected = [ek, ev]

        def fn(key, value, k_cache, v_cache):
            kvops.cache_write(key, value, k_cache, v_cache, start, h0)

        self.run_call("cache_write", kind, fn, (key, value, k_cache, v_cache), [kb, vb], expected, error)

    def test_cache_roll(self):
        fuzz(self, contiguous_cases, ROLL_BAD, self.cache_roll)

    def cache_roll(self, c):
        gen = torch.Generator().manual_seed(c["seed"])
        kb, vb, k_cache, v_cache = contiguous_buffers(c, gen)
        src, dst, n, h0, nh = c["src"], c["dst"], c["t"], c["h0"], c["h_in"]
        kind, error = c["kind"], None
        if kind == "range":
            src, error = c["s"] - n + 1, (RuntimeError, "Invalid kvops.cache_roll range")
        elif kind == "negative":
            n, error = -1, (RuntimeError, "Invalid kvops.cache_roll range")
        elif kind == "num_heads":
            nh, error = 0, (ValueError, "num_heads must be positive")
        elif kind == "head_slice":
            nh, error = c["h"] - h0 + 1, (ValueError, "is outside the cache's heads")
        elif kind == "v_none":
            v_cache, error = None, (ValueError, "v_cache must be provided")
        expected = None
        if kind is None:
            expected = [kb.clone(), vb.clone()]
            for e in expected:
                moved = e[:, 1 + src : 1 + src + n, 1 + h0 : 1 + h0 + nh].clone()
                e[:, 1 + dst : 1 + dst + n, 1 + h0 : 1 + h0 + nh] = moved

        def fn(k_cache, v_cache):
            kvops.cache_roll(k_cache, v_cache, src, dst, n, h0, nh)

        self.run_call("cache_roll", kind, fn, (k_cache, v_cache), [kb, vb], expected, error)


# --- paged_cache_write -------------------------------------------------------------------------------------------
PAGED_WRITE_BAD = ["slot_dtype", "slot_rank", "short_key", "head_dim", "dtype", "no_head_start", "head_slice",
                   "fp8_no_scale", "scale_not_fp8", "scale_shape", "v_none", "value_none", "layout"]


@st.composite
def paged_write_cases(draw, kind):
    p, bs, h = draw(st.integers(1, 5)), draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 4))
    h_in = draw(st.integers(1, h))
    n = draw(st.integers(0, min(8, p * bs) + 2))
    slots = draw(st.lists(st.integers(-3, p * bs - 1), min_size=n, max_size=n,
                          unique_by=lambda x: x if x >= 0 else object()))  # non-negative slots unique
    return dict(p=p, bs=bs, h=h, h_in=h_in, h0=draw(st.integers(0, h - h_in)), slots=slots,
                extra_rows=draw(st.integers(0, 2)), d=draw(st.sampled_from([4, 80])),
                dtype=draw(st.sampled_from(DTYPES + (FP8,))), slot_dtype=draw(st.sampled_from([torch.int32,
                                                                                               torch.int64])),
                per_head_scale=draw(st.booleans()), seed=draw(st.integers(0, 2**16)), kind=kind)


class TestFuzzPagedWrite(FuzzCase):
    def test_paged_cache_write(self):
        fuzz(self, paged_write_cases, PAGED_WRITE_BAD, self.paged_cache_write)

    def paged_cache_write(self, c):
        gen = torch.Generator().manual_seed(c["seed"])
        fp8, src_dtype = c["dtype"] == FP8, torch.float32 if c["dtype"] == FP8 else c["dtype"]
        shape = (c["p"] + 2, c["bs"], c["h"] + 2, c["d"])  # guard blocks 0 and P+1, guard heads 0 and H+1
        # 0: separate K/V, 1: [P, bs, 2, H, D] joint, 2: [P, 2, bs, H, D] joint (all NHD); 3: HND buffers
        # [P, H, bs, D] and 4: HND views of NHD buffers, both passed with kv_layout="HND". kb/vb are NHD views.
        layout = c["seed"] % 5
        kv_layout = "HND" if layout >= 3 else "NHD"
        if layout == 0 or layout == 4:
            kb, vb = rand(shape, src_dtype, gen).to(c["dtype"]), rand(shape, src_dtype, gen).to(c["dtype"])
        elif layout == 3:
            hnd = (shape[0], shape[2], shape[1], shape[3])
            kb = rand(hnd, src_dtype, gen).to(c["dtype"]).transpose(1, 2)
            vb = rand(hnd, src_dtype, gen).to(c["dtype"]).transpose(1, 2)
        else:
            kv = rand((shape[0], shape[1], 2, *shape[2:]) if layout == 1 else (shape[0], 2, *shape[1:]), src_dtype,
                      gen).to(c["dtype"])
            kb, vb = (kv[:, :, 0], kv[:, :, 1]) if layout == 1 else (kv[:, 0], kv[:, 1])
        k_cache, v_cache = kb[1:-1, :, 1:-1], vb[1:-1, :, 1:-1]
        n = len(c["slots"])
        key = rand((n + c["extra_rows"], c["h_in"], c["d"]), src_dtype, gen) * 4
        value = rand((n + c["extra_rows"], c["h_in"], c["d"]), src_dtype, gen) * 4
        slots = torch.tensor(c["slots"], dtype=c["slot_dtype"])
        h0 = c["h0"] if c["h_in"] != c["h"] or c["seed"] % 2 else None
        scale_len = c["h"] if c["per_head_scale"] else 1
        k_scale = torch.rand(scale_len, generator=gen) + 0.25 if fp8 else None
        v_scale = torch.rand(scale_len, generator=gen) + 0.25 if fp8 else None
        kind, error = c["kind"], None
        if kind == "slot_dtype":
            slots, error = slots.float(), (ValueError, "slot_mapping must be a 1-D int32 or int64 tensor")
        elif kind == "slot_rank":
            slots, error = slots.view(1, -1), (ValueError, "slot_mapping must be a 1-D int32 or int64 tensor")
        elif kind == "short_key":
            slots = torch.tensor(c["slots"] + [-1] * (c["extra_rows"] + 1), dtype=c["slot_dtype"])
            error = (ValueError, "tokens but slot_mapping has")
        elif kind == "head_dim":
            key, error = torch.cat([key, key[..., :1]], -1), (ValueError, "head_dim mismatch")
        elif kind == "dtype":
            key = key.double()
            error = (ValueError, "cannot be quantized into a" if fp8 else "key dtype torch.float64 does not match")
        elif kind == "no_head_start":
            key = rand((n + c["extra_rows"], c["h"] + 1, c["d"]), src_dtype, gen)
            value = rand((n + c["extra_rows"], c["h"] + 1, c["d"]), src_dtype, gen)
            h0, error = None, (ValueError, "requires cache_head_start when cache heads")
        elif kind == "head_slice":
            h0, error = c["h"] - c["h_in"] + 1, (ValueError, "is outside the cache's heads")
        elif kind == "fp8_no_scale":
            if not fp8:
                kb, vb = kb.float().to(FP8), vb.float().to(FP8)
                k_cache, v_cache = kb[1:-1, :, 1:-1], vb[1:-1, :, 1:-1]
                key, value = key.float(), value.float()
            k_scale, error = None, (ValueError, "cache needs k_scale and v_scale")
        elif kind == "scale_not_fp8":
            if fp8:
                kb, vb = kb.float(), vb.float()
                k_cache, v_cache = kb[1:-1, :, 1:-1], vb[1:-1, :, 1:-1]
                key, value = key.float(), value.float()
            k_scale, v_scale = torch.ones(1), torch.ones(1)
            error = (ValueError, "scales apply only to")
        elif kind == "scale_shape":
            if not fp8:
                kb, vb = kb.float().to(FP8), vb.float().to(FP8)
                k_cache, v_cache = kb[1:-1, :, 1:-1], vb[1:-1, :, 1:-1]
                key, value = key.float(), value.float()
            k_scale, v_scale = torch.ones(c["h"] + 1), torch.ones(1)
            error = (ValueError, "k_scale must be a float32 tensor of shape [1]")
        elif kind == "v_none":
            v_cache, error = None, (ValueError, "v_cache must be provided")
        elif kind == "value_none":
            value, error = None, (ValueError, "value must be provided")
        elif kind == "layout":
            kv_layout, error = "HDN", (ValueError, "kv_layout must be \"NHD\"")
        expected = None
        if kind is None:
            expected = [kb.clone(), vb.clone()]
            first = h0 or 0
            for x, e, scale in ((key, expected[0], k_scale), (value, expected[1], v_scale)):
                if fp8:
                    s = scale if scale.shape[0] == 1 else scale[first : first + c["h_in"]]
                    x = (x.float() / s.view(1, -1, 1)).clamp(-448, 448).to(FP8)
                for i, slot in enumerate(c["slots"]):
                    if slot >= 0:
                        blk, row = slot // c["bs"], slot % c["bs"]
                        bits(e)[1 + blk, row, 1 + first : 1 + first + c["h_in"]] = bits(x[i])
        if kv_layout == "HND":
            k_cache = k_cache.transpose(1, 2)
            v_cache = v_cache.transpose(1, 2) if v_cache is not None else None
        tensors = (key, value, k_cache, v_cache, slots, k_scale, v_scale)

        def fn(key, value, k_cache, v_cache, slots, k_scale, v_scale):
            kvops.paged_cache_write(key, value, k_cache, v_cache, slots, h0, k_scale, v_scale, kv_layout=kv_layout)

        self.run_call("paged_cache_write", kind, fn, tensors, [kb, vb], expected, error)


# --- paged_attention ---------------------------------------------------------------------------------------------
ATTN_BAD = ["v_none", "q_dtype", "cache_dtype", "gqa", "head_dim", "table_dtype", "seq_lens_len", "cu_len",
            "max_seqlen_q", "window", "softcap", "sinks", "fp8_no_scale", "scale_not_fp8", "layout", "mask_dtype",
            "mask_both"]
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@st.composite
def attention_cases(draw, kind):
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(2 if kind == "gqa" else 1, 2))  # with one KV head every H_q is a multiple
    return dict(b=b, hkv=hkv, kind=kind, group=draw(st.sampled_from([1, 2, 5, 7])), bs=draw(st.sampled_from([1, 2, 4])),
                d=draw(st.sampled_from([8, 80])), seq_lens=draw(st.lists(st.integers(0, 9), min_size=b, max_size=b)),
                q_frac=draw(st.lists(st.integers(0, 3), min_size=b, max_size=b)), causal=draw(st.booleans()),
                window=draw(st.sampled_from([-1, -1, 0, 2])), softcap=draw(st.sampled_from([0.0, 0.0, 3.0])),
                sinks=draw(st.booleans()), dtype=draw(st.sampled_from(DTYPES + (FP8,))),
                seed=draw(st.integers(0, 2**16)),
                mask=draw(st.sampled_from(["bool", "packed"] if kind in ("mask_dtype", "mask_both") else
                                          [None, None, "bool", "packed"])))


class TestFuzzPagedAttention(FuzzCase):
    def test_paged_attention(self):
        fuzz(self, attention_cases, ATTN_BAD, self.paged_attention)

    def paged_attention(self, c):
        gen = torch.Generator().manual_seed(c["seed"])
        fp8 = c["dtype"] == FP8
        q_dtype = torch.float32 if fp8 else c["dtype"]
        hq, bs, d = c["hkv"] * c["group"], c["bs"], c["d"]
        q_lens = [min(f, s) if s else f for f, s in zip(c["q_frac"], c["seq_lens"])]
        blocks = [-(-s // bs) for s in c["seq_lens"]]
        p = sum(blocks) + 2  # two blocks no sequence references (NaN: must never be read)
        max_blocks = max(1, max(blocks))
        k_cache = rand((p, bs, c["hkv"], d), torch.float32, gen)
        v_cache = rand((p, bs, c["hkv"], d), torch.float32, gen)
        perm = torch.randperm(p, generator=gen)
        table = torch.full((c["b"], max_blocks), -1, dtype=torch.int32)
        used = 0
        for i, nb in enumerate(blocks):
            table[i, :nb] = perm[used : used + nb].to(torch.int32)
            used += nb
        for blk in perm[used:]:
            k_cache[blk], v_cache[blk] = float("nan"), float("inf")
        for i, s in enumerate(c["seq_lens"]):  # slots past seq_len in a sequence's last block: NaN too
            for j in range(s, blocks[i] * bs):
                k_cache[int(table[i, j // bs]), j % bs] = float("nan")
        k_cache, v_cache = k_cache.to(c["dtype"]), v_cache.to(c["dtype"])
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        q = rand((int(cu[-1]), hq, d), q_dtype, gen)
        seq_lens = torch.tensor(c["seq_lens"], dtype=torch.int32)
        sinks = torch.randn(hq, generator=gen) if c["sinks"] else None
        ks, vs = (torch.rand(c["hkv"], generator=gen) + 0.5, torch.rand(1, generator=gen) + 0.5) if fp8 else (None,
                                                                                                               None)
        max_q, window, softcap = max(1, max(q_lens)), c["window"], c["softcap"]
        kind, error = c["kind"], None
        masks = custom = packed = None
        if c["mask"] is not None:  # a random mask among each sequence's new keys (docs/tree-mask.md)
            masks = [torch.rand(n, n, generator=gen) > 0.3 for n in q_lens]
            custom = torch.cat([m.flatten() for m in masks])
            if c["mask"] == "packed":
                packed, custom = segment_packbits(custom, mask_indptr(cu))[0], None
        if kind == "v_none":
            v_cache, error = None, (ValueError, "v_cache must be provided")
        elif kind == "q_dtype":
            q, error = q.double(), (ValueError, "q dtype torch.float64 is not supported")
        elif kind == "cache_dtype":
            q = q.half() if q.dtype != torch.float16 else q.float()
            error = (ValueError, "does not match q dtype") if not fp8 else (ValueError, "")
            if fp8:
                kind = None  # fp8 caches accept any supported q dtype
        elif kind == "gqa":
            q, error = torch.cat([q, q[:, :1]], 1), (ValueError, "must be a multiple of num_kv_heads")
        elif kind == "head_dim":
            q, error = torch.cat([q, q[..., :1]], -1), (ValueError, "head_dim mismatch")
        elif kind == "table_dtype":
            table, error = table.long(), (ValueError, "block_table must be a 2-D int32 tensor")
        elif kind == "seq_lens_len":
            seq_lens, error = torch.cat([seq_lens, seq_lens[:1]]), (ValueError, "inconsistent batch size")
        elif kind == "cu_len":
            cu, error = cu[:-1], (ValueError, "inconsistent batch size")
        elif kind == "max_seqlen_q":
            if q.shape[0] == 0:
                q, cu = rand((1, hq, d), q.dtype, gen), torch.tensor([0] * c["b"] + [1], dtype=torch.int32)
            max_q, error = 0, (ValueError, "max_seqlen_q must be >= 1")
        elif kind == "window":
            window, error = -2, (ValueError, "window_left must be -1 (no window) or >= 0")
        elif kind == "softcap":
            softcap, error = -1.0, (ValueError, "softcap must be >= 0")
        elif kind == "sinks":
            sinks, error = torch.zeros(hq + 1), (ValueError, "sinks must be a float32 tensor of shape")
        elif kind == "fp8_no_scale":
            if not fp8:
                k_cache, v_cache = k_cache.float().to(FP8), v_cache.float().to(FP8)
                q = q.float()
            ks, vs, error = None, None, (ValueError, "cache needs k_scale and v_scale")
        elif kind == "mask_dtype":
            custom, packed = (packed if packed is not None else custom).float(), None
            error = (ValueError, "custom_mask must be a 1-D bool tensor")
        elif kind == "mask_both":
            if custom is None:
                custom = torch.zeros(0, dtype=torch.bool)
            else:
                packed = segment_packbits(custom, mask_indptr(cu))[0]
            error = (ValueError, "not both")
        elif kind == "scale_not_fp8":
            if fp8:
                k_cache, v_cache, q = k_cache.float(), v_cache.float(), q.float()
            ks, vs, error = torch.ones(1), torch.ones(1), (ValueError, "scales apply only to")
        kv_layout = "HND" if c["seed"] % 2 and kind != "layout" else "NHD"  # HND: the NHD caches' transposed views
        if kind == "layout":  # (NHD-shaped caches: the wrapper's eager value checks read the geometry first)
            error = (ValueError, "kv_layout must be \"NHD\"")
        to_layout = (lambda t: t.transpose(1, 2) if t is not None else None) if kv_layout == "HND" else (lambda t: t)
        tensors = (q, to_layout(k_cache), to_layout(v_cache), cu, seq_lens, table, sinks, ks, vs, custom, packed)
        layout_arg = "nhd" if kind == "layout" else kv_layout

        def fn(q, k_cache, v_cache, cu, seq_lens, table, sinks, ks, vs, custom, packed):
            return kvops.paged_attention(q, k_cache, v_cache, cu, seq_lens, table, max_q, causal=c["causal"],
                                         window_left=window, softcap=softcap, sinks=sinks, k_scale=ks, v_scale=vs,
                                         kv_layout=layout_arg, custom_mask=custom, packed_custom_mask=packed)

        def check(out):
            flat = None if masks is None else torch.cat([m.flatten() for m in masks])  # (either form: one mask)
            want, _ = reference(q, k_cache, v_cache, cu, seq_lens, table, scale=d**-0.5, causal=c["causal"],
                                window_left=window, softcap=softcap, sinks=sinks, k_scale=ks, v_scale=vs,
                                custom_mask=flat)
            self.assertFalse(torch.isnan(out).any())
            tol = TOL[q.dtype] * (4 if fp8 else 1)
            torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)

        buffers = [k_cache] + ([v_cache] if v_cache is not None else [])
        self.run_call("paged_attention", kind, fn, tensors, buffers, None, error, check)


def tearDownModule():
    print("\nkvops fuzz calls per op:", dict(sorted(CALLS.items())))


if __name__ == "__main__":
    unittest.main()

"""Rotary embeddings in the cache write: ``kvops.rotary_paged_cache_write``, ``kvops.apply_rotary`` and
``flash_attn_with_kvcache(rotary_cos=..., rotary_sin=...)`` (FlashAttention semantics), against an fp64 reference that
rotates with complex multiplication (a different formula from the kernels')."""

from __future__ import annotations

import itertools
import math
import os
import unittest

import expecttest
import torch

import kvops
from kvops.cpu import rotary as cpu_kernel
from tests.contract import raises_everywhere


def rope_ref(x, cos, sin, pos, interleaved):
    """fp64 reference: pair ``(a, b)`` of dims -> ``(a + ib) * (cos + i sin)``; dims past ``rotary_dim`` unchanged."""
    rd = 2 * cos.shape[1]
    xr = x[..., :rd].double()
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
    else:
        a, b = xr[..., : rd // 2], xr[..., rd // 2 :]
    z = torch.complex(a, b) * torch.complex(cos[pos].double(), sin[pos].double()).unsqueeze(-2)
    rot = torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
    return torch.cat((rot, x[..., rd:].double()), -1)


def tables(seqlen_ro, rotary_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(seqlen_ro, rotary_dim // 2, generator=g, dtype=torch.float64) * 2 * math.pi
    return angle.cos().to(dtype), angle.sin().to(dtype)


TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def attention_ref(q, k, v, seq_len, causal, window_left, scale):
    """fp64 attention of ``q [S_q, H_q, D]`` over ``k, v [L, H_kv, D]`` (bottom-right aligned)."""
    s_q, h_q, _ = q.shape
    group = h_q // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    qpos = seq_len - s_q + torch.arange(s_q)[:, None]
    kpos = torch.arange(seq_len)[None, :]
    visible = torch.ones(s_q, seq_len, dtype=torch.bool)
    if causal:
        visible &= kpos <= qpos
    if window_left >= 0:
        visible &= kpos >= qpos - window_left
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1))
    return torch.einsum("hqk,khd->qhd", p, vv)


class TestFlashAttnKVCacheRotary(expecttest.TestCase):
    """Port of FlashAttention's ``test_flash_attn_kvcache`` rotary cases: ``rotary_fraction`` in {0.5, 1.0} (0.0 is
    the unrotated path tested in test_flash_attn_api), interleaved or not, causal / local / neither, contiguous or
    paged (shuffled blocks), ``seqlen_q`` 1 or 3, GQA 3:1, fp32 and bf16."""

    def run_case(self, dtype, fraction, interleaved, mode, block_size, s_q):
        g = torch.Generator().manual_seed(hash((fraction, interleaved, mode, block_size, s_q)) % 1000)
        b, h_q, h_kv, d, cap, s_new = 2, 6, 2, 32, 16, s_q
        causal, window = {"causal": (True, (-1, -1)), "local": (False, (3, 0)), "none": (False, (-1, -1))}[mode]
        rd = int(d * fraction)
        cos, sin = tables(cap, rd, dtype, seed=s_q)
        rand = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
        q, k, v = rand(b, s_q, h_q, d), rand(b, s_new, h_kv, d), rand(b, s_new, h_kv, d)
        seqlens = torch.randint(0, cap - s_new + 1, (b,), generator=g, dtype=torch.int32)
        if block_size is None:
            k_cache, v_cache, table = rand(b, cap, h_kv, d), rand(b, cap, h_kv, d), None
        else:
            nb = cap // block_size
            k_cache, v_cache = rand(b * nb, block_size, h_kv, d), rand(b * nb, block_size, h_kv, d)
            table = torch.randperm(b * nb, generator=g).view(b, nb).to(torch.int32)
        # reference (as FlashAttention's test): rotate q and the new k at their positions, write, attend
        local = causal or window != (-1, -1)
        q_pos = seqlens.long()[:, None] + (torch.arange(s_q) if local else torch.zeros(s_q, dtype=torch.long))
        k_pos = seqlens.long()[:, None] + torch.arange(s_new)
        q_ro, k_ro = rope_ref(q, cos, sin, q_pos, interleaved), rope_ref(k, cos, sin, k_pos, interleaved)

        def logical(cache, i):  # [cap, H, D] view of sequence i in logical order
            return cache[i] if table is None else cache[table[i].long()].flatten(0, 1)

        out = kvops.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                            cache_seqlens=seqlens, block_table=table, causal=causal,
                                            window_size=window, rotary_interleaved=interleaved)
        for i in range(b):
            n0 = int(seqlens[i])
            keys, vals = logical(k_cache, i)[: n0 + s_new], logical(v_cache, i)[: n0 + s_new]
            torch.testing.assert_close(keys[n0:].double(), k_ro[i], **TOL[dtype])  # rotated k written at n0..
            self.assertTrue(torch.equal(vals[n0:], v[i]))  # values are not rotated
            want = attention_ref(q_ro[i], keys, vals, n0 + s_new, causal or window[1] == 0, window[0], d ** -0.5)
            torch.testing.assert_close(out[i].double(), want, **TOL[dtype])

    def test_cases(self):
        cases = list(itertools.product([torch.float32], [0.5, 1.0], [False, True], ["causal", "local", "none"],
                                       [None, 4], [1, 3]))
        cases += list(itertools.product([torch.bfloat16], [0.5], [False, True], ["causal", "none"], [None, 4], [3]))
        for case in cases:
            with self.subTest(case=case):
                self.run_case(*case)


class TestRotaryWrite(expecttest.TestCase):
    def setUp(self):
        g = torch.Generator().manual_seed(0)
        self.key = torch.randn(7, 3, 20, generator=g)
        self.value = torch.randn(7, 3, 12, generator=g)
        self.slots = torch.tensor([5, -1, 0, 9, 3, -1, 14])
        self.pos = torch.tensor([2, 0, 7, 3, 11, 5, 1], dtype=torch.int32)

    def caches(self, dtype=torch.float32):
        return torch.zeros(4, 4, 3, 20, dtype=dtype), torch.zeros(4, 4, 3, 12, dtype=dtype)

    def test_against_reference(self):
        """GPT-NeoX / GPT-J, full and partial rotary_dim (12 of 20, head_dim 20 is not a power of two): slots
        written with the rotated key, skipped slots untouched, values bit-exact."""
        for interleaved, rd in itertools.product([False, True], [20, 12]):
            cos, sin = tables(12, rd, torch.float32)
            k_cache, v_cache = self.caches()
            kvops.rotary_paged_cache_write(self.key, self.value, k_cache, v_cache, self.slots, self.pos, cos, sin,
                                           interleaved)
            want = rope_ref(self.key, cos, sin, self.pos.long(), interleaved)
            flat_k, flat_v = k_cache.view(16, 3, 20), v_cache.view(16, 3, 12)
            keep = self.slots >= 0
            torch.testing.assert_close(flat_k[self.slots[keep]].double(), want[keep], atol=1e-6, rtol=1e-6)
            self.assertTrue(torch.equal(flat_v[self.slots[keep]], self.value[keep]))
            untouched = torch.ones(16, dtype=torch.bool)
            untouched[self.slots[keep]] = False
            self.assertEqual(int(flat_k[untouched].abs().sum()), 0)

    def test_key_and_value_longer_than_slot_mapping(self):
        """Rows ``>= N`` of key and value are ignored (the documented ``[N', H_in, D]``): only the first 5 tokens are
        written. The CPU kernel cut the rotated key to N rows but not the value (IndexError from index_copy_)."""
        cos, sin = tables(12, 20, torch.float32)
        k_cache, v_cache = self.caches()
        kvops.rotary_paged_cache_write(self.key, self.value, k_cache, v_cache, self.slots[:5], self.pos, cos, sin)
        keep = self.slots[:5] >= 0
        want = rope_ref(self.key[:5], cos, sin, self.pos[:5].long(), False)
        torch.testing.assert_close(k_cache.view(16, 3, 20)[self.slots[:5][keep]].double(), want[keep], atol=1e-6,
                                   rtol=1e-6)
        self.assertTrue(torch.equal(v_cache.view(16, 3, 12)[self.slots[:5][keep]], self.value[:5][keep]))
        self.assertEqual(int((v_cache != 0).any(-1).any(-1).sum()), int(keep.sum()))

    def test_head_slice_and_joint_cache(self):
        kv = torch.zeros(4, 4, 2, 5, 20)
        cos, sin = tables(12, 20, torch.float32)
        kvops.rotary_paged_cache_write(self.key, self.key, kv[:, :, 0], kv[:, :, 1], self.slots, self.pos, cos, sin,
                                       True, cache_head_start=2)
        want = rope_ref(self.key, cos, sin, self.pos.long(), True).float()
        keep = self.slots >= 0
        got_k = kv[:, :, 0].reshape(16, 5, 20)[self.slots[keep]]
        torch.testing.assert_close(got_k[:, 2:], want[keep], atol=1e-6, rtol=1e-6)
        self.assertEqual(int(got_k[:, :2].abs().sum()), 0)
        self.assertTrue(torch.equal(kv[:, :, 1].reshape(16, 5, 20)[self.slots[keep]][:, 2:], self.key[keep]))

    def test_apply_rotary_matches_write(self):
        cos, sin = tables(12, 12, torch.float32)
        got = kvops.apply_rotary(self.key, cos, sin, self.pos, rotary_interleaved=False)
        torch.testing.assert_close(got.double(), rope_ref(self.key, cos, sin, self.pos.long(), False),
                                   atol=1e-6, rtol=1e-6)

    def test_triton_kernel_matches_cpu_kernel(self):
        """The Triton kernel (interpreter on CPU, compiled on CUDA) vs the CPU kernel: fp32, bf16, fp8 cache."""
        from kvops.triton import rotary as triton_kernel

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            self.skipTest("no GPU and TRITON_INTERPRET is not set")  # conftest sets it on CPU-only machines
        fp8 = torch.float8_e4m3fn
        for dtype, interleaved, cache_dtype in [(torch.float32, False, None), (torch.bfloat16, True, None),
                                                (torch.float32, True, fp8)]:
            cos, sin = tables(12, 12, dtype)
            key, value = (self.key * 20).to(dtype), self.value.to(dtype)
            k_cache, v_cache = self.caches(cache_dtype or dtype)
            scales = (torch.tensor([0.5]), torch.tensor([0.25])) if cache_dtype else (None, None)
            cpu_k, cpu_v = k_cache.clone(), v_cache.clone()
            cpu_kernel.rotary_paged_cache_write(key, value, cpu_k, cpu_v, self.slots, self.pos, cos, sin,
                                                interleaved, 0, *scales)
            dev = [t.to(device) if t is not None else None for t in
                   (key, value, k_cache, v_cache, self.slots, self.pos, cos, sin, *scales)]
            triton_kernel.rotary_paged_cache_write(*dev[:8], interleaved, 0, *dev[8:])
            bits = (lambda t: t.cpu().view(torch.uint8)) if cache_dtype else (lambda t: t.cpu())  # noqa: E731
            with self.subTest(dtype=dtype, cache=cache_dtype):
                self.assertTrue(torch.equal(bits(dev[3]), bits(cpu_v)))
                if cache_dtype:  # one fp8 code apart at most (fp32 rounding of the rotation may differ by an ulp)
                    diff = (dev[2].cpu().float() - cpu_k.float()).abs()
                    self.assertLessEqual(float(diff.max()), 0.25 * float(cpu_k.float().abs().max()) / 8)
                else:
                    torch.testing.assert_close(dev[2].cpu(), cpu_k, **TOL[dtype])

    def test_opcheck(self):
        cos, sin = tables(12, 12, torch.float32)
        k_cache, v_cache = self.caches()
        torch.library.opcheck(torch.ops.kvops.rotary_paged_cache_write.default,
                              (self.key, self.value, k_cache, v_cache, self.slots, self.pos, cos, sin, True),
                              test_utils=("test_schema", "test_faketensor"))


class TestRotaryContracts(expecttest.TestCase):
    def setUp(self):
        self.key, self.value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
        self.k_cache, self.v_cache = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
        self.slots, self.pos = torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2])
        self.cos, self.sin = tables(8, 16, torch.float32)

    def write_error(self, *, cos=None, sin=None, pos=None, key=None):
        args = (self.key if key is None else key, self.value, self.k_cache, self.v_cache, self.slots,
                self.pos if pos is None else pos, self.cos if cos is None else cos, self.sin if sin is None else sin)
        return raises_everywhere(self, ValueError, lambda *a: kvops.rotary_paged_cache_write(*a), args)

    def test_rotary_dim_too_large(self):
        cos, sin = tables(8, 20, torch.float32)
        self.assertExpectedInline(self.write_error(cos=cos, sin=sin), """kvops.rotary_paged_cache_write: rotary_dim must be <= headdim: rotary_cos (8, 10) gives rotary_dim 20 but key has head_dim 16 (and rotary_dim must be > 0). Pass tables [seqlen_ro, rotary_dim / 2] with rotary_dim <= 16; transformers' cos/sin [seq, head_dim] repeat their halves: pass their first head_dim // 2 columns, cos[:, :8] and sin[:, :8].""")

    def test_table_dtype_and_shape(self):
        self.assertExpectedInline(self.write_error(cos=self.cos.double(), sin=self.sin.double()), """kvops.rotary_paged_cache_write: rotary_cos must have the same dtype as key (torch.float32), got torch.float64. Cast the tables with .to(torch.float32).""")
        self.assertExpectedInline(self.write_error(sin=self.sin[:4]), """kvops.rotary_paged_cache_write: rotary_sin must be 2-D (seqlen_ro, rotary_dim / 2), rotary_cos and rotary_sin of one shape; got rotary_cos (8, 8) and rotary_sin (4, 8).""")

    def test_positions(self):
        self.assertExpectedInline(self.write_error(pos=self.pos[:2]), """kvops.rotary_paged_cache_write: positions has 2 entries but slot_mapping has 3 tokens; pass one position per token.""")
        self.assertExpectedInline(self.write_error(pos=self.pos.float()), """kvops.rotary_paged_cache_write: positions must be a 1-D int32 or int64 tensor [num_tokens] (the rotary position of each token), got shape (3,) and dtype torch.float32. Pass positions.to(torch.int64) (built with integer ops: // rather than /).""")

    def test_paged_write_errors_keep_their_wording(self):
        self.assertExpectedInline(self.write_error(key=self.key.half()), """kvops.rotary_paged_cache_write: key dtype torch.float16 does not match k_cache dtype torch.float32. Cast key to torch.float32.""")

    def test_flash_attn_rotary_errors(self):
        f = kvops.flash_attn_with_kvcache
        q, k = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16)
        kc = torch.zeros(2, 8, 2, 16)
        compile_exc = torch._dynamo.exc.Unsupported  # a composite: its checks run while Dynamo traces

        def check(fn, *args):
            return raises_everywhere(self, ValueError, fn, args, compile_exc=compile_exc)

        self.assertExpectedInline(check(lambda q, kc, c, s: f(q, kc, kc, rotary_cos=c, rotary_sin=s, cache_seqlens=1),
                                        q, kc, self.cos, self.sin), """flash_attn_with_kvcache: If rotary cos/sin are provided, new key / value to be appended to KV cache must also be provided (pass k and v, or rotary_cos=None and rotary_sin=None).""")
        self.assertExpectedInline(check(lambda q, kc, k, c, s: f(q, kc, kc, k, k, rotary_cos=c, rotary_sin=s,
                                                                 cache_seqlens=1), q, kc, k, self.cos[:4],
                                        self.sin[:4]), """flash_attn_with_kvcache: cos/sin seqlen must be at least the seqlen of KV cache: rotary_cos has 4 positions but the cache holds 8 (max_blocks x block_size); extend the tables.""")
        self.assertExpectedInline(check(lambda q, kc, k, c: f(q, kc, kc, k, k, rotary_cos=c, cache_seqlens=1),
                                        q, kc, k, self.cos), """flash_attn_with_kvcache: rotary_cos and rotary_sin must be given together (got only rotary_cos).""")

    def test_apply_rotary_positions_shape(self):
        msg = raises_everywhere(self, ValueError, lambda x, c, s, p: kvops.apply_rotary(x, c, s, p),
                                (self.key, self.cos, self.sin, self.pos[:2]), compile_exc=torch._dynamo.exc.Unsupported)
        self.assertExpectedInline(msg, """kvops.apply_rotary: positions must have shape x.shape[:-2] = (3,) (one position per token), got (2,). Pass one position per token of x: a tensor of shape [3].""")


class TestRotaryLowering(expecttest.TestCase):
    def test_rotation_fused_into_the_store(self):
        """k = sin(x) * 2 -> rotary write (GPT-J, partial): no extern kvops call, caches equal eager's, a negative
        slot skipped; ``positions`` and ``slot_mapping`` as tensors, so nothing specializes on their values."""
        from torch._inductor.utils import fresh_inductor_cache

        from tests.inductor_utils import code_facts, compiled

        def step(x, value, k_cache, v_cache, slots, pos, cos, sin):
            kvops.rotary_paged_cache_write(torch.sin(x) * 2, value, k_cache, v_cache, slots, pos, cos, sin, True)
            return k_cache.sum()

        g = torch.Generator().manual_seed(3)
        x, value = torch.randn(5, 2, 24, generator=g), torch.randn(5, 2, 24, generator=g)
        slots, pos = torch.tensor([3, -1, 8, 0, 11]), torch.tensor([4, 2, 0, 7, 1])
        cos, sin = tables(8, 16, torch.float32)
        eager = [torch.zeros(3, 4, 2, 24), torch.zeros(3, 4, 2, 24)]
        step(x, value, *eager, slots, pos, cos, sin)
        caches = [torch.zeros(3, 4, 2, 24), torch.zeros(3, 4, 2, 24)]
        with fresh_inductor_cache():
            _, code = compiled(step, x, value, *caches, slots, pos, cos, sin)
        self.assertEqual(code_facts(code).split(", ")[1], "kvops calls: 0")
        torch.testing.assert_close(caches[0], eager[0], atol=1e-6, rtol=1e-6)
        self.assertTrue(torch.equal(caches[1], eager[1]))


class TestStreamingSinksRope(unittest.TestCase):
    """StreamingLLM with RoPE: keys stored *before* RoPE in a CausalKVCache with sink tokens; at read time the visible
    window is rotated to its positions within the cache (0..V-1) and the query to V-1. The output equals attention
    computed from scratch over exactly the kept tokens (sink + most recent) at contiguous positions -- the property
    transformers' former SinkCache broke (kept keys kept their original positions while new keys drifted)."""

    def test_equals_from_scratch_over_kept_tokens(self):
        from kvops.cache import CausalKVCache

        sink, size, h, d, steps = 2, 8, 2, 16, 20
        g = torch.Generator().manual_seed(5)
        raw_k, raw_v, raw_q = (torch.randn(steps, 1, h, d, generator=g) for _ in range(3))
        cos, sin = tables(64, d, torch.float32)
        cache = CausalKVCache.allocate(1, size, h, d, dtype=torch.float32, sink_tokens=sink)
        for t in range(steps):
            view = cache.update_and_get_attention_kv(raw_k[t][None], raw_v[t][None], current_chunk_start=t)
            k, v = view.k[0], view.v[0]  # [V, H, D], unrotated
            n = k.shape[0]
            k_rot = kvops.apply_rotary(k, cos, sin, torch.arange(n))
            q_rot = kvops.apply_rotary(raw_q[t], cos, sin, torch.tensor([n - 1]))
            out = kvops.flash_attn_with_kvcache(q_rot[None], k_rot[None], v[None], cache_seqlens=n, causal=True)
            kept = list(range(min(sink, t + 1))) + list(range(max(sink, t + 1 - (size - sink)), t + 1))
            self.assertEqual(n, len(kept))
            keys = rope_ref(raw_k[kept, 0], cos, sin, torch.arange(n), False)
            want = attention_ref(rope_ref(raw_q[t], cos, sin, torch.tensor([n - 1]), False), keys,
                                 raw_v[kept, 0].double(), n, True, -1, d ** -0.5)
            torch.testing.assert_close(out[0].double(), want, atol=1e-5, rtol=1e-5)

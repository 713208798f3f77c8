"""Sizes near the integer limits, in every attention kernel.

* KV lengths near 2^31 (valid int32 ``seq_lens`` that fit the block table: a few large blocks, all entries one block)
  with a window, sinks, ``cache_leftpad``, ALiBi, a right window, prefill and decode: the native kernel segfaulted at
  ``seq_len >= 2^31 - 122`` (int32 positions plus a prefetch distance), the Triton kernels wrapped int32 positions.
  Native calls run in a child process (``tests/unhappy.py:run_isolated``: a crash is a test failure, not the end of the
  run); the Triton kernels in the interpreter.
* "Unbounded" arguments: ``window_right``, ``window_left`` and ``sink_tokens`` of ``sys.maxsize`` mean what an
  unbounded value means (no int64 overflow such as ``pos + window_right + 1``), in the native, composite and Triton
  kernels and through ``flash_attn_with_kvcache``.
* FlashInfer-style ``plan`` with more keys than int32 ``seq_lens`` hold is refused (it wrapped ``kv_len`` to 3).
* Caches whose size passes the addressable bytes are refused naming the arguments and the byte count.
"""

from __future__ import annotations

import json
import os
import sys
import unittest

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import expecttest  # noqa: E402

import kvops  # noqa: E402
from kvops._checks.features import AttnFeatures  # noqa: E402
from kvops.cpu.paged_attention import paged_attention as composite  # noqa: E402
from kvops.reference.attention import reference  # noqa: E402
from tests.unhappy import check_failing_call, run_isolated  # noqa: E402

I32 = torch.int32
BIG = 2**31 - 1
BS = 1 << 16  # block size of the near-2^31 cases: a table of 32768 entries, one 4 MB block


def near_limit_cases():
    """``(name, seq_len, q_len, kwargs)`` of the near-2^31 calls (all read a few rows only)."""
    return [
        ("decode window d8 (the crash)", BIG, 1, dict(window_left=4)),
        ("decode window at 2^31 - 122", BIG - 121, 1, dict(window_left=4)),
        ("prefill causal window", BIG, 3, dict(window_left=6)),
        ("sinks + window + rope", BIG, 2, dict(window_left=3, sink_tokens=2, rope_theta=1e4)),
        ("alibi + window", BIG, 2, dict(window_left=5, alibi=True)),
        ("not causal, right window", BIG - 3, 2, dict(causal=False, window_left=2, window_right=1)),
        ("cache_leftpad near the end", BIG, 2, dict(leftpad=BIG - 9)),
    ]


def near_limit_inputs(seq_len, q_len, kw, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.randn(1, BS, 1, d, generator=g), torch.randn(1, BS, 1, d, generator=g)
    q = torch.randn(q_len, 2, d, generator=g)
    args = (q, kc, vc, torch.tensor([0, q_len], dtype=I32), torch.tensor([seq_len], dtype=I32),
            torch.zeros(1, -(-seq_len // BS), dtype=I32))
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.tensor([0.25, 0.5])
    if "leftpad" in kw:
        kw["cache_leftpad"] = torch.tensor([kw.pop("leftpad")], dtype=I32)
    return args, kw


def worst_error(out, want) -> float:
    return float((out.double() - want).abs().max())


class TestNearInt32Lengths(unittest.TestCase):
    def test_native_kernel_in_a_child_process(self):
        """The native kernel at seq_len 2^31 - 1 and 2^31 - 122 (segfaulted before): right results, no crash."""
        code = """
            import json, torch, kvops
            from tests.errors.test_unhappy_limits import near_limit_cases, near_limit_inputs, worst_error
            from kvops.reference.attention import reference
            assert kvops.native.available()
            errors = {}
            for name, seq_len, q_len, kw in near_limit_cases():
                args, kw = near_limit_inputs(seq_len, q_len, kw)
                out = kvops.paged_attention(*args, q_len, **kw)
                ref_kw = {k: v for k, v in kw.items()}
                errors[name] = worst_error(out, reference(*args, **ref_kw)[0])
            print("ERRORS" + json.dumps(errors))
            """
        proc = run_isolated(code, timeout=600)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("ERRORS")), None)
        self.assertIsNotNone(line, proc.stderr[-3000:])
        errors = json.loads(line[len("ERRORS"):])
        self.assertEqual({k: v < 1e-5 for k, v in errors.items()}, dict.fromkeys(errors, True), errors)

    def test_triton_kernels(self):
        """Decode and prefill Triton kernels (interpreter) at the same lengths: int64 positions, right results."""
        from kvops.triton.paged_attention import paged_attention as triton_pa

        for name, seq_len, q_len, kw in near_limit_cases():
            # (RoPE: the Triton kernels turn by fp32 angles, exact to positions of about 2^24, not 2^31)
            args, kw = near_limit_inputs(seq_len, q_len, {k: v for k, v in kw.items() if k != "rope_theta"})
            want = reference(*args, **kw)[0]
            feats = {k: kw[k] for k in ("alibi_slopes", "window_right", "cache_leftpad", "sink_tokens", "rope_theta")
                     if k in kw}
            for force_prefill in (False, True) if q_len == 1 else (True,):
                with self.subTest(name, prefill=force_prefill):
                    out, _ = triton_pa(*args, q_len, 8 ** -0.5, kw.get("causal", True), kw.get("window_left", -1),
                                       0.0, None, None, None, AttnFeatures(**feats), force_prefill=force_prefill)
                    self.assertLess(worst_error(out, want), 1e-5)


def small_inputs(seed=0, lens=(9, 21), q_lens=(1, 3), block_size=4, h_q=4, h_kv=2, d=16):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    table = torch.randperm(sum(need), generator=g).to(I32)
    rows = torch.full((len(lens), max(need)), -1, dtype=I32)
    at = 0
    for b, n in enumerate(need):
        rows[b, :n] = table[at:at + n]
        at += n
    kc = torch.randn(sum(need), block_size, h_kv, d, generator=g)
    vc = torch.randn(sum(need), block_size, h_kv, d, generator=g)
    q = torch.randn(sum(q_lens), h_q, d, generator=g)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=I32)
    return q, kc, vc, cu, torch.tensor(lens, dtype=I32), rows, max(q_lens)


class TestUnboundedArguments(unittest.TestCase):
    """sys.maxsize as window_right / window_left / sink_tokens: as unbounded (before: off by more than 1 before)."""

    CASES = [  # (name, kwargs with sys.maxsize, the same call unbounded by other means)
        ("window_right maxsize, not causal", dict(causal=False, window_right=sys.maxsize), dict(causal=False)),
        ("window_left maxsize", dict(window_left=sys.maxsize), {}),
        ("window_left 2^31", dict(window_left=2**31), {}),
        ("sink_tokens maxsize + leftpad", dict(window_left=2, sink_tokens=sys.maxsize, leftpad=True), dict(leftpad=True)),
        ("sink_tokens maxsize, rope", dict(window_left=1, sink_tokens=sys.maxsize, rope_theta=1e4),
         dict(rope_theta=1e4)),
        ("both windows maxsize, alibi", dict(causal=False, window_left=sys.maxsize, window_right=sys.maxsize,
                                             alibi=True), dict(causal=False, alibi=True)),
    ]

    def resolve(self, kw):
        kw = dict(kw)
        if kw.pop("leftpad", False):
            kw["cache_leftpad"] = torch.tensor([2, 5], dtype=I32)
        if kw.pop("alibi", False):
            kw["alibi_slopes"] = torch.tensor([0.1, 0.2, 0.3, 0.4])
        return kw

    def test_every_backend(self):
        from kvops.triton.paged_attention import paged_attention as triton_pa

        args = small_inputs()
        for name, huge, plain in self.CASES:
            huge, plain = self.resolve(huge), self.resolve(plain)
            want = reference(*args[:6], **plain)[0]
            with self.subTest(name, backend="kvops.paged_attention (native)"):
                self.assertLess(worst_error(kvops.paged_attention(*args, **huge), want), 1e-5)
            pos = dict(scale=16 ** -0.5, causal=huge.get("causal", True), window_left=huge.get("window_left", -1),
                       softcap=0.0, sinks=None, k_scale=None, v_scale=None)
            feats = {k: v for k, v in huge.items() if k not in pos}
            with self.subTest(name, backend="composite"):
                out, _ = composite(*args, *pos.values(), AttnFeatures(**feats))
                self.assertLess(worst_error(out, want), 1e-5)
            with self.subTest(name, backend="triton"):
                out, _ = triton_pa(*args, *pos.values(), AttnFeatures(**feats))
                self.assertLess(worst_error(out, want), 1e-5)
            with self.subTest(name, backend="torch.ops.kvops._paged_attention_native"):
                out, _ = torch.ops.kvops._paged_attention_native(
                    *args, pos["scale"], pos["causal"], pos["window_left"], 0.0, None, None, None,
                    huge.get("alibi_slopes"), huge.get("window_right", -1), huge.get("cache_leftpad"),
                    huge.get("sink_tokens", 0), huge.get("rope_theta"), 1.0)
                self.assertLess(worst_error(out, want), 1e-5)

    def test_flash_attn_window_size_maxsize(self):
        """``flash_attn_with_kvcache(window_size=(-1, sys.maxsize), causal=False)`` as ``(-1, -1)``."""
        g = torch.Generator().manual_seed(3)
        q, kc, vc = torch.randn(2, 2, 4, 8, generator=g), torch.randn(2, 8, 2, 8, generator=g), torch.randn(
            2, 8, 2, 8, generator=g)
        lens = torch.tensor([5, 8], dtype=I32)
        want = kvops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=False)
        got = kvops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=False, window_size=(-1, sys.maxsize))
        self.assertTrue(torch.equal(got, want))


class TestFlashInferPlan(expecttest.TestCase):
    def test_kv_len_past_int32_is_refused(self):
        """4097 pages of 2^20 tokens: kv_len 2^32 + 2^20 wrapped to int32 (3 keys) and ``run`` attended to 3 keys."""
        from kvops.integrations.flashinfer import BatchDecodeWithPagedKVCacheWrapper

        w = BatchDecodeWithPagedKVCacheWrapper()
        plan = (torch.tensor([0, 1, 4098], dtype=I32), torch.zeros(4098, dtype=I32),
                torch.tensor([5, 3], dtype=I32), 2, 1, 8, 2**20)
        msg = check_failing_call(self, lambda: w.plan(*plan), ValueError, ["sequence 1", "kv_len = 4294967299"],
                                 state=w)
        self.assertExpectedInline(msg, """BatchDecodeWithPagedKVCacheWrapper.plan: sequence 1 has 4097 pages of page_size 1048576 (last_page_len 3), kv_len = 4294967299 keys, more than the 2147483647 an int32 sequence length holds (kvops.paged_attention's seq_lens). Split the sequence, or pass fewer pages.""")  # noqa: B950
        ok = (torch.tensor([0, 2048], dtype=I32), torch.zeros(2048, dtype=I32), torch.tensor([2**20 - 1], dtype=I32),
              2, 1, 8, 2**20)  # 2^31 - 1 keys: the longest int32 length plans
        w.plan(*ok)
        self.assertEqual(int(w._plan["seq_lens"][0]), 2**31 - 1)

    def test_non_finite_scalars_are_refused_at_plan(self):
        from kvops.integrations.flashinfer import BatchDecodeWithPagedKVCacheWrapper

        w = BatchDecodeWithPagedKVCacheWrapper()
        plan = (torch.tensor([0, 1], dtype=I32), torch.zeros(1, dtype=I32), torch.tensor([1], dtype=I32), 2, 1, 8, 4)
        for kw, name in ((dict(logits_soft_cap=float("nan")), "logits_soft_cap"), (dict(sm_scale=float("inf")),
                                                                                    "sm_scale"),
                         (dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=float("inf")), "rope_theta")):
            with self.subTest(name):
                check_failing_call(self, lambda: w.plan(*plan, **kw), ValueError, [name, "must be a finite"],
                                   state=w)


class TestCacheSizes(expecttest.TestCase):
    """Buffers past the addressable bytes: a ValueError naming the arguments and the byte count, before allocating."""

    def test_every_cache_class(self):
        from kvops.cache import PackedCausalKVCache, PagedKVCache, RingCausalKVCache, RollingKVCache

        huge = 2**50
        cases = [
            ("PagedKVCache", lambda: PagedKVCache(huge, 16, 8, 128), "num_blocks=1125899906842624"),
            ("PagedKVCache joint", lambda: PagedKVCache(2**31, 2**16, 8, 128, joint=True), "block_size=65536"),
            ("CausalKVCache.allocate", lambda: kvops.CausalKVCache.allocate(1, huge, 8, 128), "cache_size="),
            ("RingCausalKVCache.allocate", lambda: RingCausalKVCache.allocate(4, huge, 8, 128), "batch_size=4"),
            ("RollingKVCache.allocate", lambda: RollingKVCache.allocate(1, huge, 8, 128), "window_size="),
            ("PackedCausalKVCache", lambda: PackedCausalKVCache.allocate(1, huge, 8, 128, chunk_tokens=4,
                                                                         quant="int8"), "chunk_tokens=4"),
        ]
        for owner, make, needle in cases:
            with self.subTest(owner):
                msg = check_failing_call(self, make, ValueError, [owner.split()[0], needle, "bytes", "128 TiB"])
        msg = check_failing_call(self, cases[0][1], ValueError, [])
        self.assertExpectedInline(msg, """PagedKVCache: num_blocks=1125899906842624, block_size=16, num_kv_heads=8, head_dim=128, head_dim_v=128, num_layers=1 (torch.float32) need 147573952589676412928 bytes (134217728.0 TiB) of K/V buffers, more than a process can address (140737488355328 bytes, 128 TiB). Pass smaller sizes (fewer blocks or tokens, layers or heads).""")  # noqa: B950

    def test_an_allocator_failure_names_the_arguments(self):
        """Within the addressable bytes but past the memory: the allocator's exception type, the arguments first."""
        from unittest import mock

        from kvops.cache import PagedKVCache

        def fail(*a, **k):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

        with mock.patch("torch.zeros", fail):
            msg = check_failing_call(self, lambda: PagedKVCache(2**20, 16, 8, 128, num_layers=2), torch.OutOfMemoryError,
                                     ["PagedKVCache", "num_blocks=1048576", "274877906944 bytes", "out of memory"])
        self.assertTrue(msg.startswith("PagedKVCache: allocating 274877906944 bytes (256.0 GiB) of K/V buffers"))

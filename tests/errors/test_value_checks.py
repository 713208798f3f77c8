"""Value contracts (docs/semantics.md §7): checks of slot / block-id / length *contents* in the three modes.

eager (default): every documented violation raises ``RuntimeError`` before anything is written, with the argument,
index, value, bound and fix in the message. async: ``torch._assert_async`` in eager code, under ``torch.compile``
(Inductor) and in ``torch.export`` programs; a failing write writes nothing (caches compared with clones). off: no
check runs. Rows owned by no sequence (``cu_seqlens_q[-1] < T_q``) are zeros in the CPU and Triton kernels.
"""

from __future__ import annotations

import os
import unittest
from unittest import mock

import torch

if not torch.cuda.is_available():  # before triton.jit decorates the kernels (tests/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import expecttest  # noqa: E402
import torch._dynamo  # noqa: E402

import kvops  # noqa: E402
from kvops._checks import values  # noqa: E402
from tests.contract import _Wrap  # noqa: E402
from tests.paged.test_paged_attention import make_inputs, reference  # noqa: E402


def paged_caches(num_blocks=4, block_size=8, heads=2, d=16, joint=False):
    if joint:  # K/V as strided views of one [P, block_size, 2, H_kv, D] allocation
        kv = torch.randn(num_blocks, block_size, 2, heads, d)
        return kv[:, :, 0], kv[:, :, 1]
    return torch.randn(num_blocks, block_size, heads, d), torch.randn(num_blocks, block_size, heads, d)


def attn_inputs():
    """Two sequences (KV lengths 5 and 19, q_len 1 and 3), block_size 4, 2 KV heads, GQA 2:1; unused entries -1."""
    return make_inputs(0, [5, 19], [1, 3], block_size=4, h_q=4, h_kv=2, d=16)


def attend(x, **over):
    a = {**x, **over}
    return kvops.paged_attention(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"],
                                 a["block_table"], a["max_seqlen_q"], return_lse=True)


class TestModes(unittest.TestCase):
    def test_default_set_and_context_manager(self):
        self.assertEqual(kvops.get_value_checks(), "eager")
        with kvops.value_checks("async"):
            self.assertEqual(kvops.get_value_checks(), "async")
            with kvops.value_checks("off"):
                self.assertEqual(kvops.get_value_checks(), "off")
            self.assertEqual(kvops.get_value_checks(), "async")
        self.assertEqual(kvops.get_value_checks(), "eager")
        try:
            kvops.set_value_checks("off")
            self.assertEqual(kvops.get_value_checks(), "off")
        finally:
            kvops.set_value_checks("eager")
        with self.assertRaisesRegex(ValueError, r"mode must be one of \('eager', 'async', 'off'\), got 'fast'"):
            kvops.set_value_checks("fast")
        with self.assertRaises(ValueError):
            kvops.value_checks("on")

    def test_contexts_in_threads_exited_out_of_order(self):
        """Two threads' ``value_checks`` blocks, exited out of order (real threads, forced interleaving):
        each thread sees its own mode, the other thread's block never changes it, and afterwards the process is
        back in "eager" (before, it was left in "off" for good and an over-capacity cache_seqlens passed)."""
        import threading

        a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
        seen, errors = {}, []

        def thread_a():  # enters "off" first, exits first
            try:
                with kvops.value_checks("off"):
                    a_in.set()
                    b_in.wait(10)
                    seen["a inside"] = kvops.get_value_checks()
                a_out.set()
                seen["a after"] = kvops.get_value_checks()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        def thread_b():  # enters "async" second, exits last
            try:
                a_in.wait(10)
                with kvops.value_checks("async"):
                    b_in.set()
                    a_out.wait(10)
                    seen["b inside"] = kvops.get_value_checks()
                seen["b after"] = kvops.get_value_checks()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=f) for f in (thread_a, thread_b)]
        for t in threads:
            t.start()
        seen["main during"] = kvops.get_value_checks()
        for t in threads:
            t.join(20)
        self.assertEqual(errors, [])
        self.assertEqual(seen, {"a inside": "off", "a after": "eager", "b inside": "async", "b after": "eager",
                                "main during": "eager"})
        self.assertEqual(kvops.get_value_checks(), "eager")
        q, kc = torch.randn(1, 1, 2, 8), torch.zeros(2, 4, 2, 8)  # still refused
        with self.assertRaisesRegex(RuntimeError, "cache_seqlens=9"):
            kvops.flash_attn_with_kvcache(q, kc, kc.clone(), torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8),
                                          cache_seqlens=torch.tensor([9], dtype=torch.int32),
                                          block_table=torch.tensor([[0, 1]], dtype=torch.int32))

    def test_set_value_checks_inside_a_context_and_in_threads(self):
        """``set_value_checks`` inside a block changes that block's mode (restored at its end); outside any block it
        sets the process default, which threads without a block of their own see."""
        import threading

        with kvops.value_checks("off"):
            kvops.set_value_checks("async")
            self.assertEqual(kvops.get_value_checks(), "async")
        self.assertEqual(kvops.get_value_checks(), "eager")
        seen = []
        try:
            kvops.set_value_checks("off")
            t = threading.Thread(target=lambda: seen.append(kvops.get_value_checks()))
            t.start()
            t.join(10)
        finally:
            kvops.set_value_checks("eager")
        self.assertEqual(seen, ["off"])

    def test_mode_is_guarded_by_compiled_code(self):
        k_cache, v_cache = paged_caches()
        key, good = torch.randn(2, 2, 16), torch.tensor([0, 31])
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm.code)
            return gm

        torch._dynamo.reset()
        compiled = torch.compile(kvops.paged_cache_write, fullgraph=True, backend=backend)
        compiled(key, key, k_cache, v_cache, good)  # eager mode: nothing emitted while tracing (no host sync)
        with kvops.value_checks("async"):
            compiled(key, key, k_cache, v_cache, good)  # the mode is guarded: recompiled with the assert
        self.assertEqual(["_assert_async" in code for code in graphs], [False, True])

    def test_off_runs_no_check(self):
        k_cache, _ = paged_caches()
        slots = torch.tensor([1, 99])
        with kvops.value_checks("off"):
            self.assertIs(values.check_paged_write(slots, k_cache), slots)
            x = attn_inputs()
            attend(x, max_seqlen_q=1)  # q_len 3 > max_seqlen_q: unchecked (wrong values), but no error


class TestPagedWrite(expecttest.TestCase):
    def test_eager_bad_slot_raises_before_writing(self):
        for joint in (False, True):
            k_cache, v_cache = paged_caches(joint=joint)
            before_k, before_v = k_cache.clone(), v_cache.clone()
            key = torch.randn(4, 2, 16)
            with self.assertRaises(RuntimeError) as cm:
                kvops.paged_cache_write(key, key, k_cache, v_cache, torch.tensor([3, -1, 32, 0]))
            self.assertTrue(torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v))  # slot 3 not written
        self.assertExpectedInline(str(cm.exception), """kvops.paged_cache_write: slot_mapping[2] = 32 is outside the cache: valid slots are [0, 32) (4 blocks x block_size 8), or negative to skip a padding token. Nothing was written. Pass block * block_size + row for a block of the cache (or -1 for padding).""")  # noqa: E501
        with self.assertRaises(RuntimeError) as cm2:  # the debug check is the same eager check
            kvops.check_slot_mapping(torch.tensor([3, -1, 32, 0]), k_cache)
        self.assertEqual(str(cm2.exception), str(cm.exception))

    def test_hnd_capacity(self):
        """HND caches [P, H_kv, block_size, D]: the bound is P * block_size with block_size from dim 2 (not H_kv)."""
        k_cache = torch.zeros(3, 2, 8, 16)  # P 3, H_kv 2, block_size 8: 24 slots
        v_cache = torch.zeros_like(k_cache)
        key = torch.randn(2, 2, 16)
        kvops.paged_cache_write(key, key, k_cache, v_cache, torch.tensor([23, -1]), kv_layout="HND")
        self.assertTrue(torch.equal(k_cache[2, :, 7], key[0]))
        before = k_cache.clone()
        with self.assertRaisesRegex(RuntimeError, r"slot_mapping\[1\] = 24 is outside the cache: valid slots are "
                                                  r"\[0, 24\) \(3 blocks x block_size 8\)"):
            kvops.paged_cache_write(key, key, k_cache, v_cache, torch.tensor([0, 24]), kv_layout="HND")
        self.assertTrue(torch.equal(k_cache, before))

    def test_metadata_errors_come_first(self):
        """An HND cache passed as NHD misreads block_size (2 instead of 8): the layout error wins over the slot."""
        k_cache = torch.zeros(3, 2, 8, 16)
        key = torch.randn(2, 2, 16)
        for mode in ("eager", "async"):
            with kvops.value_checks(mode), self.assertRaisesRegex(ValueError, 'pass kv_layout="HND"'):
                kvops.paged_cache_write(key, key, k_cache, k_cache.clone(), torch.tensor([0, 10]))
        x = attn_inputs()
        with self.assertRaisesRegex(ValueError, "max_seqlen_q must be >= 1"):  # not the q_len value error
            attend(x, max_seqlen_q=0)

    def test_async_eager_masks_the_whole_batch(self):
        """The write never depends on the assert's ordering: a failing batch is routed to slot -1 (skip)."""
        k_cache, _ = paged_caches()
        with kvops.value_checks("async"), mock.patch.object(values, "_assert") as fake_assert:
            masked = values.check_paged_write(torch.tensor([3, 40, 0]), k_cache)
            kept = values.check_paged_write(torch.tensor([3, 31, -1]), k_cache)
        self.assertEqual(masked.tolist(), [-1, -1, -1])
        self.assertEqual(kept.tolist(), [3, 31, -1])
        self.assertEqual([bool(c.args[0]) for c in fake_assert.call_args_list], [False, True])

    def test_compiled_unchecked_modes_skip_a_batch_with_a_slot_past_the_cache(self):
        """Without the async check (modes "eager" — nothing emitted while tracing — and "off"), the Inductor lowering
        still never writes part of a batch or outside the cache: a slot >= P * block_size skips the whole batch (it
        used to write the earlier tokens, then fail the kernel's bounds check, which can abort the process)."""
        for mode in ("eager", "off"):
            k_cache, v_cache = paged_caches(joint=True)
            key = torch.randn(3, 2, 16)
            k_before, v_before = k_cache.clone(), v_cache.clone()
            torch._dynamo.reset()
            with kvops.value_checks(mode):
                compiled = torch.compile(kvops.paged_cache_write, fullgraph=True)
                compiled(key, key, k_cache, v_cache, torch.tensor([1, 2, 40]))
                self.assertTrue(torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before), mode)
                compiled(key, key, k_cache, v_cache, torch.tensor([1, 31, -1]))  # the same graph writes a valid batch
            for cache, want in ((k_cache, k_before), (v_cache, v_before)):
                want[0, 1], want[3, 7] = key[0], key[1]
                self.assertTrue(torch.equal(cache, want), mode)

    def test_async_compiled_and_exported(self):
        k_cache, v_cache = paged_caches(joint=True)
        key = torch.randn(3, 2, 16)
        bad, good = torch.tensor([1, 2, 40]), torch.tensor([1, 31, -1])
        with kvops.value_checks("async"):
            before = k_cache.clone()
            with self.assertRaisesRegex(RuntimeError, "slot_mapping holds a slot >= num_blocks"):
                kvops.paged_cache_write(key, key, k_cache, v_cache, bad)
            self.assertTrue(torch.equal(k_cache, before))

            torch._dynamo.reset()
            compiled = torch.compile(kvops.paged_cache_write, fullgraph=True)  # Inductor: the write is lowered
            with self.assertRaises(RuntimeError) as cm:
                compiled(key, key, k_cache, v_cache, bad)
            self.assertTrue(torch.equal(k_cache, before))
            self.assertExpectedInline(str(cm.exception), """kvops.paged_cache_write: slot_mapping holds a slot >= num_blocks * block_size = 32 (outside the cache); nothing was written. Run with kvops.value_checks('eager') to see the slot.""")  # noqa: E501
            compiled(key, key, k_cache, v_cache, good)  # the same graph writes a valid batch
            want = before.clone()
            want[0, 1], want[3, 7] = key[0], key[1]
            self.assertTrue(torch.equal(k_cache, want))

            k_cache.copy_(before)
            ep = torch.export.export(_Wrap(kvops.paged_cache_write), (key, key, k_cache, v_cache, good))
        self.assertIn("_assert_async", str(ep.graph))
        with self.assertRaisesRegex(RuntimeError, "slot_mapping holds a slot"):  # the program asserts in any mode
            ep.module()(key, key, k_cache, v_cache, bad)
        self.assertTrue(torch.equal(k_cache, before))

    def test_kernel_backends_raise_index_error(self):
        """Default mode, backends that run the op's kernel (no lowering): the kernel's ``IndexError``, nothing written
        (README "Value checks", docs/semantics.md §7)."""
        k_cache, v_cache = paged_caches()
        key = torch.randn(3, 2, 16)
        bad, good = torch.tensor([1, 2, 40]), torch.tensor([1, 31, -1])
        before = k_cache.clone()
        torch._dynamo.reset()
        compiled = torch.compile(kvops.paged_cache_write, fullgraph=True, backend="aot_eager")
        ep = torch.export.export(_Wrap(kvops.paged_cache_write), (key, key, k_cache, v_cache, good))
        for run in (compiled, ep.module()):
            with self.assertRaises(IndexError) as cm:
                run(key, key, k_cache, v_cache, bad)
            self.assertTrue(torch.equal(k_cache, before))
            self.assertExpectedInline(str(cm.exception), """kvops.paged_cache_write: slot_mapping holds slot 40 but the cache has only 32 slots (4 blocks x block_size 8); valid slots are [0, 32) or negative (skip).""")  # noqa: E501

    def test_eager_mode_emits_nothing_while_tracing(self):
        k_cache, v_cache = paged_caches()
        key = torch.randn(2, 2, 16)
        ep = torch.export.export(_Wrap(kvops.paged_cache_write), (key, key, k_cache, v_cache, torch.tensor([0, 1])))
        self.assertNotIn("_assert_async", str(ep.graph))


class TestPagedAttention(expecttest.TestCase):
    def error(self, x, **over):
        with self.assertRaises(RuntimeError) as cm:
            attend(x, **over)
        return str(cm.exception)

    def test_eager_errors(self):
        x = attn_inputs()
        p = x["k_cache"].shape[0]
        self.assertExpectedInline(self.error(x, max_seqlen_q=2), """kvops.paged_attention: sequence 1 has q_len 3 (cu_seqlens_q[2] - cu_seqlens_q[1]) but max_seqlen_q=2; pass max_seqlen_q >= 3, the longest query length in the batch.""")  # noqa: E501
        table = x["block_table"]
        width = table.shape[1]
        self.assertExpectedInline(self.error(x, seq_lens=torch.tensor([5, 4 * width + 1], dtype=torch.int32)), """kvops.paged_attention: seq_lens[1] = 29 is outside [0, 28], the capacity of block_table: 7 blocks per sequence x block_size 4. Give block_table more columns (max_blocks >= ceil(seq_len / block_size)) or pass the sequence's real KV length.""")  # noqa: E501
        self.assertIn("seq_lens[0] = -1", self.error(x, seq_lens=torch.tensor([-1, 19], dtype=torch.int32)))
        t = table.clone()
        t[1, 4] = p  # positions 16..18 of sequence 1 (seq_len 19 uses 5 entries)
        self.assertIn(f"block_table[1, 4] = {p} is not a block", self.error(x, block_table=t))
        t[1, 4] = -1
        self.assertExpectedInline(self.error(x, block_table=t), """kvops.paged_attention: block_table[1, 4] = -1 is not a block of the cache: block ids must be in [0, 10) (P = 10 blocks). Sequence 1 (seq_len 19) uses its first 5 entries; entries past those are never read and may hold any value (e.g. -1).""")  # noqa: E501
        t = table.clone()
        t[0, 2] = p  # sequence 0 (seq_len 5) uses 2 entries: entry 2 is never read
        attend(x, block_table=t)
        self.assertExpectedInline(self.error(x, cu_seqlens_q=torch.tensor([0, 3, 1], dtype=torch.int32)), """kvops.paged_attention: cu_seqlens_q = [0, 3, 1] must be non-decreasing from 0 to at most q's 4 rows (T_q); sequence b owns q rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]). Pass the cumulative query lengths.""")  # noqa: E501
        for cu in ([1, 2, 4], [0, 1, 5]):  # not starting at 0; ending past T_q = 4
            self.assertIn(f"cu_seqlens_q = {cu}", self.error(x, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32)))

    def test_hnd_block_table_capacity(self):
        x = attn_inputs()
        hnd = {"k_cache": x["k_cache"].transpose(1, 2), "v_cache": x["v_cache"].transpose(1, 2)}  # [P, H_kv, bs, D]
        out, _ = kvops.paged_attention(x["q"], hnd["k_cache"], hnd["v_cache"], x["cu_seqlens_q"], x["seq_lens"],
                                       x["block_table"], 3, return_lse=True, kv_layout="HND")
        torch.testing.assert_close(out, attend(x)[0])
        with self.assertRaisesRegex(RuntimeError, r"seq_lens\[1\] = 29 is outside \[0, 28\]"):  # block_size 4
            kvops.paged_attention(x["q"], hnd["k_cache"], hnd["v_cache"], x["cu_seqlens_q"],
                                  torch.tensor([5, 29], dtype=torch.int32), x["block_table"], 3, kv_layout="HND")

    def test_rows_owned_by_no_sequence_are_zero(self):
        x = attn_inputs()
        pad = {"q": torch.cat([x["q"], torch.randn(3, *x["q"].shape[1:])])}  # T_q = 7, cu_seqlens_q[-1] = 4
        out, lse = attend(x, **pad)
        want, want_lse = attend(x)
        self.assertTrue(torch.equal(out[:4], want) and torch.equal(lse[:, :4], want_lse))
        self.assertTrue(torch.equal(out[4:], torch.zeros_like(out[4:])))
        self.assertTrue(bool(torch.isneginf(lse[:, 4:]).all()))
        ref, _ = reference(pad["q"], x["k_cache"], x["v_cache"], x["cu_seqlens_q"], x["seq_lens"], x["block_table"])
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)

    def test_rows_owned_by_no_sequence_are_zero_triton(self):
        from kvops.triton import paged_attention as tri

        x = attn_inputs()
        q = torch.cat([x["q"], torch.randn(3, *x["q"].shape[1:])])
        for max_q, cu, lens in ((3, x["cu_seqlens_q"], x["seq_lens"]),  # prefill kernel
                                (1, torch.tensor([0, 1, 2], dtype=torch.int32), x["seq_lens"])):  # split-KV decode
            out, lse = tri.paged_attention(q, x["k_cache"], x["v_cache"], cu, lens, x["block_table"], max_q, 0.25,
                                           True, -1, 0.0, None, None, None, block_n=16, block_m=16)
            end = int(cu[-1])
            self.assertTrue(torch.equal(out[end:], torch.zeros_like(out[end:])))
            self.assertTrue(bool(torch.isneginf(lse[:, end:]).all()))
            ref, _ = reference(q, x["k_cache"], x["v_cache"], cu, lens, x["block_table"], scale=0.25)
            torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)

    def test_async_compiled_and_exported(self):
        x = attn_inputs()
        t = x["block_table"].clone()
        t[1, 4] = x["k_cache"].shape[0]

        def fn(q, k_cache, v_cache, cu, lens, table):
            return kvops.paged_attention(q, k_cache, v_cache, cu, lens, table, 3)

        args = (x["q"], x["k_cache"], x["v_cache"], x["cu_seqlens_q"], x["seq_lens"])
        with kvops.value_checks("async"):
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
            torch.testing.assert_close(compiled(*args, x["block_table"]), attend(x)[0])
            p = x["k_cache"].shape[0]
            with self.assertRaisesRegex(RuntimeError, rf"block_table holds a block id outside \[0, P = {p}\)"):
                compiled(*args, t)
            ep = torch.export.export(_Wrap(fn), (*args, x["block_table"]))
        with self.assertRaisesRegex(RuntimeError, "block_table holds a block id"):
            ep.module()(*args, t)
        with self.assertRaisesRegex(RuntimeError, "a sequence's q_len exceeds max_seqlen_q = 3"):
            ep.module()(*args[:3], torch.tensor([0, 0, 4], dtype=torch.int32), args[4], x["block_table"])


class TestFlashAttnWithKVCache(expecttest.TestCase):
    """FlashAttention's ``test_flash_attn_kvcache_paged_block_table_bounds``: RuntimeError matching "block_table"."""

    def setUp(self):
        self.k_cache, self.v_cache = paged_caches(num_blocks=6, block_size=4)
        self.table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)  # capacity 8 tokens per sequence
        self.q, self.k = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16)

    def call(self, lens, table=None):
        return kvops.flash_attn_with_kvcache(self.q, self.k_cache, self.v_cache, self.k, self.k, cache_seqlens=lens,
                                             block_table=self.table if table is None else table, causal=True)

    def test_block_table_bounds(self):
        before = self.k_cache.clone()
        lens = torch.tensor([2, 6], dtype=torch.int32)  # sequence 1 needs positions [0, 9) of 8
        with self.assertRaisesRegex(RuntimeError, "block_table"):
            self.call(lens)
        self.assertTrue(torch.equal(self.k_cache, before))  # sequence 0 was not written either
        with self.assertRaises(RuntimeError) as cm:
            kvops.check_kvcache_capacity(self.k_cache, lens, self.table, num_new_tokens=3)
        self.assertExpectedInline(str(cm.exception), """flash_attn_with_kvcache: sequence 1 has cache_seqlens=6; with 3 new tokens it needs positions [0, 9) but block_table addresses only 8 tokens (2 blocks x block_size 4). Give block_table more blocks or write fewer tokens.""")  # noqa: E501
        self.assertRaisesRegex(RuntimeError, "cache_seqlens=-1", self.call, torch.tensor([-1, 0], dtype=torch.int32))
        bad = torch.tensor([[0, 6], [2, 3]], dtype=torch.int32)
        with self.assertRaises(RuntimeError) as cm:
            self.call(torch.tensor([2, 0], dtype=torch.int32), bad)  # sequence 0 reaches position 4: block 6
        self.assertExpectedInline(str(cm.exception), """flash_attn_with_kvcache: block_table[0, 1] = 6 is not a block of the cache: block ids must be in [0, 6) (P = 6 blocks) for the blocks sequence 0 uses.""")  # noqa: E501
        self.assertTrue(torch.equal(self.k_cache, before))
        self.call(torch.tensor([1, 0], dtype=torch.int32), bad)  # positions [0, 4): entry 1 unused

    def test_async_compiled(self):
        before = self.k_cache.clone()
        lens = torch.tensor([2, 6], dtype=torch.int32)
        with kvops.value_checks("async"):
            torch._dynamo.reset()
            fn = torch.compile(self.call, fullgraph=True, backend="aot_eager")
            with self.assertRaisesRegex(RuntimeError, "exceed the capacity addressable by block_table"):
                fn(lens)
            self.assertTrue(torch.equal(self.k_cache, before))
            with mock.patch.object(values, "_assert"):  # even an assert that does not stop the program
                self.call(lens)
            self.assertTrue(torch.equal(self.k_cache, before))


class TestTorchWarnings(unittest.TestCase):
    def test_no_script_method_deprecation_from_inductor_import(self):
        """The 14 ``torch.jit.script_method is deprecated`` warnings of the compile tests come from torch's
        ``torch.utils.mkldnn``, imported by Inductor; tests/conftest.py imports it once with that warning silenced."""
        import subprocess
        import sys

        code = "import tests.conftest, torch._inductor.compile_fx"
        run = subprocess.run([sys.executable, "-W", "error::DeprecationWarning:torch.jit._script", "-c", code],
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), capture_output=True,
                             text=True, timeout=300)
        self.assertEqual(run.returncode, 0, run.stderr[-2000:])


if __name__ == "__main__":
    unittest.main()

"""ONNX export of kvops ops (lowering/onnx.py), run in onnxruntime's CPU provider and compared with eager.

Each program is ``kvops.export.functionalize(torch.export.export(...))`` exported with
``torch.onnx.export(..., dynamo=True, custom_translation_table=kvops.onnx_translation_table())``. Data movement is
compared bit for bit (``np.array_equal``), attention within fp32 tolerances against the eager CPU kernel.
"""

from __future__ import annotations

import unittest

import numpy as np
import torch
import torch.utils._pytree as pytree

import kvops
from tests.export.test_export_models import DecodeStep, LLMSession, StreamSession

ort = __import__("onnxruntime")  # the `onnx` extra (pulled in by `test`)
FP8 = torch.float8_e4m3fn


def export_onnx(module: torch.nn.Module, args: tuple):
    ep = kvops.export.functionalize(torch.export.export(module, args))
    program = torch.onnx.export(ep, dynamo=True, custom_translation_table=kvops.onnx_translation_table(),
                                verbose=False)
    return ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])


def _ort_value(t: torch.Tensor):
    if t.dtype == FP8:  # numpy has no fp8: pass the bytes with the ONNX element type
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(t.view(torch.uint8).numpy(), 17)  # FLOAT8E4M3FN
    return ort.OrtValue.ortvalue_from_numpy(t.contiguous().numpy())


def run_onnx(session, args: tuple) -> list[torch.Tensor]:
    leaves = pytree.tree_leaves(args)
    feeds = {i.name: _ort_value(t) for i, t in zip(session.get_inputs(), leaves, strict=True)}
    outs = session.run_with_ort_values(None, feeds)
    result = []
    for value in outs:
        if value.data_type() == "tensor(float8e4m3fn)":  # returned as its bytes (uint8)
            result.append(torch.from_numpy(value.numpy().copy()).view(FP8))
        else:
            result.append(torch.from_numpy(value.numpy().copy()))
    return result


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == FP8:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


class PagedWrite(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, key, value, k_cache, v_cache, slot_mapping, *scales):
        scale = dict(zip(("k_scale", "v_scale"), scales))
        kvops.paged_cache_write(key, value, k_cache, v_cache, slot_mapping, **self.kwargs, **scale)
        return k_cache, v_cache


class TestPagedWrite(unittest.TestCase):
    def check(self, module, args, runs):
        """Export once with ``args``; every ``(args)`` in ``runs`` must give eager's caches bit for bit."""
        session = export_onnx(module, tuple(a.clone() for a in args))
        for run in runs:
            k_ref, v_ref = run[2].clone(), run[3].clone()
            module(run[0], run[1], k_ref, v_ref, *run[4:])
            k_got, v_got = run_onnx(session, run)
            self.assertTrue(bits_equal(k_got, k_ref) and bits_equal(v_got, v_ref))
            self.assertFalse(bits_equal(k_got, run[2]))  # something was written

    def test_negative_slots_skipped_head_slice_padded_rows(self):
        torch.manual_seed(0)
        num_blocks, block_size, heads, d = 5, 3, 3, 80
        k_cache = torch.randn(num_blocks, block_size, heads, d)  # sentinel values everywhere
        v_cache = torch.randn(num_blocks, block_size, heads, 16)
        key, value = torch.randn(7, 2, d), torch.randn(7, 2, 16)  # N' = 7 rows, N = 5 slots, heads [1, 3)
        slots = torch.tensor([14, -1, 0, 7, -3], dtype=torch.int32)  # -3 would be a real row in ONNX indexing
        runs = [(key, value, k_cache, v_cache, slots),
                (key * 2, value, k_cache, v_cache, torch.tensor([-2, -1, 3, -5, 13], dtype=torch.int32))]
        self.check(PagedWrite(cache_head_start=1), runs[0], runs)

    def test_fp8_per_head_scales(self):
        torch.manual_seed(1)
        k_cache = (torch.randn(4, 2, 2, 8) * 10).to(FP8)
        v_cache = (torch.randn(4, 2, 2, 8) * 10).to(FP8)
        key, value = torch.randn(3, 2, 8) * 300, torch.randn(3, 2, 8)  # some values saturate at +-448
        args = (key, value, k_cache, v_cache, torch.tensor([6, -1, 1]), torch.tensor([0.5, 2.0]), torch.tensor([0.1]))
        self.check(PagedWrite(), args, [args])


class ContiguousWrites(torch.nn.Module):
    """Write at a start read from a tensor (one program for every start), then an overlapping roll."""

    def forward(self, key, value, k_cache, v_cache, start, src):
        s, r = start.item(), src.item()
        torch._check(s >= 0)
        torch._check(s <= k_cache.shape[1] - key.shape[1])
        torch._check(r >= 0)
        torch._check(r <= k_cache.shape[1] - 4)
        kvops.cache_write(key, value, k_cache, v_cache, s, cache_head_start=1)
        kvops.cache_roll(k_cache, v_cache, r, 2, 4, cache_head_start=0, num_heads=2)
        return k_cache, v_cache


class TestContiguous(unittest.TestCase):
    def test_write_and_roll_with_positions_from_tensors(self):
        torch.manual_seed(2)
        k_cache, v_cache = torch.randn(2, 12, 3, 8), torch.randn(2, 12, 3, 5)
        key, value = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 5)
        module = ContiguousWrites()
        args = (key, value, k_cache, v_cache, torch.tensor(0), torch.tensor(0))
        session = export_onnx(module, tuple(a.clone() for a in args))
        for start, src in ((0, 0), (9, 4), (4, 3), (2, 8)):  # src 3 and 4 overlap dst [2, 6)
            run = (key, value, k_cache, v_cache, torch.tensor(start), torch.tensor(src))
            k_ref, v_ref = k_cache.clone(), v_cache.clone()
            module(key, value, k_ref, v_ref, run[4], run[5])
            k_got, v_got = run_onnx(session, run)
            self.assertTrue(torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref), (start, src))


class TensorPositionWrites(torch.nn.Module):
    """``cache_write`` and ``cache_roll`` with tensor positions (no ``.item()``: fixed-size masked paged writes)."""

    def forward(self, key, value, k_cache, v_cache, start, src, dst, count):
        kvops.cache_write(key, value, k_cache, v_cache, start, cache_head_start=1)
        kvops.cache_roll(k_cache, v_cache, src, dst, count, cache_head_start=0, num_heads=2)
        return k_cache, v_cache


class TestContiguousTensorPositions(unittest.TestCase):
    def test_write_and_roll_equal_the_int_forms(self):
        torch.manual_seed(3)
        k_cache, v_cache = torch.randn(2, 12, 3, 8), torch.randn(2, 12, 3, 5)
        key, value = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 5)
        t = torch.tensor
        args = (key, value, k_cache, v_cache, t(0), t(0), t(0), t(0))
        session = export_onnx(TensorPositionWrites(), tuple(a.clone() for a in args))
        # (start, src, dst, count): overlapping moves down and up, nothing moved, the whole cache, the last rows
        for start, src, dst, count in ((0, 4, 2, 4), (9, 2, 5, 6), (4, 3, 3, 0), (2, 0, 0, 12), (5, 11, 0, 1)):
            k_ref, v_ref = k_cache.clone(), v_cache.clone()
            kvops.cache_write(key, value, k_ref, v_ref, start, cache_head_start=1)
            kvops.cache_roll(k_ref, v_ref, src, dst, count, cache_head_start=0, num_heads=2)
            k_got, v_got = run_onnx(session, (key, value, k_cache, v_cache, t(start), t(src), t(dst), t(count)))
            self.assertTrue(torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref), (start, src, dst, count))


class TinyStream(torch.nn.Module):
    def forward(self, key, value, k_cache, v_cache, cursors, start):
        mask, cursors = kvops.export.streaming_update(key, value, k_cache, v_cache, cursors, start, sink_tokens=2)
        return mask, cursors, k_cache, v_cache


class TestStreamingPositions(unittest.TestCase):
    def test_appends_evictions_and_a_bad_position_that_writes_nothing(self):
        """ONNX has no assert (``kvops::stream_positions`` is an ``Identity``), but the step's moves and writes are
        masked by the same checks: a gap returns the caches unchanged."""
        g = torch.Generator().manual_seed(4)
        k_cache, v_cache = torch.zeros(2, 7, 2, 4), torch.zeros(2, 7, 2, 3)
        chunk = lambda d: torch.randn(2, 2, 2, d, generator=g)  # noqa: E731
        session = export_onnx(TinyStream(), (chunk(4), chunk(3), k_cache.clone(), v_cache.clone(),
                                             kvops.export.init_cursors(), torch.tensor(0)))
        cursors, k_ref, v_ref = kvops.export.init_cursors(), k_cache.clone(), v_cache.clone()
        for s in (0, 2, 2, 4, 6, 6, 8, 10):  # appends, rewrites, evicting appends after the sink
            key, value = chunk(4), chunk(3)
            mask, new_cursors, k_got, v_got = run_onnx(session, (key, value, k_cache, v_cache, cursors,
                                                                 torch.tensor(s)))
            want_mask, cursors = TinyStream()(key, value, k_ref, v_ref, cursors, torch.tensor(s))[:2]
            self.assertTrue(torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref), s)
            self.assertTrue(torch.equal(mask, want_mask) and torch.equal(new_cursors, cursors), s)
            k_cache, v_cache = k_got, v_got
        _, _, k_got, v_got = run_onnx(session, (chunk(4), chunk(3), k_cache, v_cache, cursors, torch.tensor(14)))
        self.assertTrue(torch.equal(k_got, k_cache) and torch.equal(v_got, v_cache))  # a gap: nothing written


class Attention(torch.nn.Module):
    def __init__(self, max_seqlen_q, extra_names=(), **kwargs):
        super().__init__()
        self.max_seqlen_q, self.extra_names, self.kwargs = max_seqlen_q, extra_names, kwargs

    def forward(self, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *extra):
        kw = dict(self.kwargs, **dict(zip(self.extra_names, extra)))
        return kvops.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, self.max_seqlen_q,
                                     return_lse=True, **kw)


def paged_batch(q_lens, seq_lens, num_blocks, block_size, heads, kv_heads, d, d_v=None, dtype=torch.float32,
                seed=0):
    """Random packed queries, caches with NaN in every slot no sequence uses, and a shuffled block table."""
    g = torch.Generator().manual_seed(seed)
    d_v = d if d_v is None else d_v
    max_blocks = max(1, max(-(-s // block_size) for s in seq_lens))
    k_cache = torch.full((num_blocks, block_size, kv_heads, d), float("nan"))
    v_cache = torch.full((num_blocks, block_size, kv_heads, d_v), float("nan"))
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, s in enumerate(seq_lens):
        nb = -(-s // block_size)
        table[b, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
        for j in range(s):
            blk, row = int(table[b, j // block_size]), j % block_size
            k_cache[blk, row] = torch.randn(kv_heads, d, generator=g)
            v_cache[blk, row] = torch.randn(kv_heads, d_v, generator=g)
    cu = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, d, generator=g)
    return q, k_cache.to(dtype), v_cache.to(dtype), cu, torch.tensor(seq_lens, dtype=torch.int32), table


class TestPagedAttention(unittest.TestCase):
    def check(self, args, max_seqlen_q, extra=(), tol=2e-5, **kwargs):
        module = Attention(max_seqlen_q, extra_names=tuple(n for n, _ in extra), **kwargs)
        full = args + tuple(t for _, t in extra)
        out, lse = module(*full)
        self.assertFalse(torch.isnan(out).any())
        session = export_onnx(module, full)
        got_out, got_lse = run_onnx(session, full)
        torch.testing.assert_close(got_out, out, atol=tol, rtol=tol)
        torch.testing.assert_close(got_lse, lse, atol=tol, rtol=tol)
        return out

    def test_gqa_7_to_1_chunked_prefill_and_decode_causal(self):
        args = paged_batch([5, 1, 3], [9, 17, 3], num_blocks=12, block_size=4, heads=14, kv_heads=2, d=64)
        self.check(args, 5)

    def test_gqa_5_to_1_window_softcap_sinks_not_causal(self):
        args = paged_batch([2, 3], [7, 11], num_blocks=12, block_size=2, heads=5, kv_heads=1, d=80, seed=3)
        sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5])
        self.check(args, 3, extra=(("sinks", sinks),), window_left=3, softcap=2.0, scale=0.2)
        self.check(args, 3, causal=False, window_left=2)

    def test_block_size_1_zero_length_sequence_and_empty_query(self):
        # sequence 1 has seq_len 0 (zeros, lse -inf), sequence 2 has no query rows
        args = paged_batch([2, 1, 0], [4, 0, 5], num_blocks=12, block_size=1, heads=4, kv_heads=2, d=8, seed=4)
        out = self.check(args, 2)
        self.assertTrue(torch.equal(out[2], torch.zeros_like(out[2])))

    def test_fp8_cache_with_scales(self):
        q, k_cache, v_cache, cu, seq_lens, table = paged_batch([3, 1], [6, 9], num_blocks=6, block_size=4, heads=4,
                                                               kv_heads=2, d=16, seed=5)
        k8, v8 = torch.nan_to_num(k_cache, 0.0).to(FP8), torch.nan_to_num(v_cache, 0.0).to(FP8)
        extra = (("k_scale", torch.tensor([0.5, 2.0])), ("v_scale", torch.tensor([1.5])))
        self.check((q, k8, v8, cu, seq_lens, table), 3, extra=extra)

    def test_hnd_layout_write_then_attention(self):
        q, k_cache, v_cache, cu, seq_lens, table = paged_batch([3, 1], [6, 9], num_blocks=7, block_size=4, heads=6,
                                                               kv_heads=2, d=8, seed=6)
        k_hnd = torch.nan_to_num(k_cache, 7.0).transpose(1, 2).contiguous()  # [P, H_kv, block_size, D]
        v_hnd = torch.nan_to_num(v_cache, 7.0).transpose(1, 2).contiguous()
        slots = torch.tensor([int(table[0, 1]) * 4 + 1, -2, -1, int(table[1, 2]) * 4])
        key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)

        class Step(torch.nn.Module):
            def forward(self, q, key, value, k_cache, v_cache, slots, cu, seq_lens, table):
                kvops.paged_cache_write(key, value, k_cache, v_cache, slots, kv_layout="HND")
                out = kvops.paged_attention(q, k_cache, v_cache, cu, seq_lens, table, 3, kv_layout="HND")
                return out, k_cache, v_cache

        args = (q, key, value, k_hnd, v_hnd, slots, cu, seq_lens, table)
        session = export_onnx(Step(), tuple(a.clone() for a in args))
        got_out, got_k, got_v = run_onnx(session, args)
        out, k_ref, v_ref = Step()(q, key, value, k_hnd.clone(), v_hnd.clone(), slots, cu, seq_lens, table)
        self.assertTrue(torch.equal(got_k, k_ref) and torch.equal(got_v, v_ref))
        self.assertFalse(torch.equal(got_k, k_hnd))
        torch.testing.assert_close(got_out, out, atol=2e-5, rtol=2e-5)

    def test_unknown_layout_is_rejected_with_a_clear_message(self):
        from kvops.lowering import onnx as onnx_lowering

        with self.assertRaises(ValueError) as cm:
            onnx_lowering.paged_cache_write(None, None, None, None, None, kv_layout="NCHW")
        self.assertIn("got kv_layout='NCHW'; expected 'NHD' or 'HND'", str(cm.exception))


class TestExamples(unittest.TestCase):
    def test_llm_decode_step_matches_eager_over_steps(self):
        session = LLMSession()
        step = DecodeStep(session.model)
        ort_session = export_onnx(step, session.decode_inputs())
        session.cache.free("a"), session.cache.free("b")
        session = LLMSession()  # the same requests again (the export advanced the block manager)
        k_ort, v_ort = [c.clone() for c in session.cache.k_caches], [c.clone() for c in session.cache.v_caches]
        for _ in range(5):
            inputs = session.decode_inputs()
            got = run_onnx(ort_session, (inputs[0], inputs[1], k_ort, v_ort, *inputs[4:]))
            with torch.no_grad():
                expected = step(*inputs)
            self.assertTrue(torch.equal(got[0], expected[0]), (got[0], expected[0]))
            k_ort, v_ort = got[1:2], got[2:3]
            torch.testing.assert_close(k_ort[0], session.cache.k_caches[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v_ort[0], session.cache.v_caches[0], atol=1e-5, rtol=1e-5)
            session.accept(expected[0])

    def test_stream_step_with_eviction_matches_eager(self):
        session = StreamSession()
        ort_session = export_onnx(session.step, session.example_inputs())

        def onnx_step(x, k_caches, v_caches, cursors, start):
            """ONNX returns the new caches; copy them into the stream's (exactly: a copy)."""
            y, new_cursors, *rest = run_onnx(ort_session, (x, k_caches, v_caches, cursors, start))
            for dst, src in zip(k_caches + v_caches, rest):
                dst.copy_(src)
            return (y, new_cursors, *rest)

        outs, k, v = session.run(onnx_step, replay=True)  # ONNX's caches == eager updates of its own K/V, bit for bit
        ref_outs, ref_k, ref_v = session.run(None, reference=True)
        self.assertEqual(len(outs), 18)  # 6 chunks x 3 passes; chunks 4 and 5 evict
        for got, expected in zip(outs, ref_outs):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        for got, expected in zip(k + v, ref_k + ref_v):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
    unittest.main()

"""The GEMM path of the native CPU paged attention (kvops/native/attend_gemm.h): work items with many rows per KV head
(chunked prefill: queries x GQA group >= 32) multiply through torch's CPU GEMM, and keep every feature of the register
kernel. Each case is checked against the fp64 oracle (kvops/reference/attention.py) and shown to take the GEMM path
(torch.profiler sees its kvops::paged_attention::gemm_path events) where rows are many, and the register kernel (no GEMM) for
decode rows."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import unittest

import torch
from torch.profiler import ProfilerActivity, profile

import kvops
import kvops.native as native
from kvops.reference.attention import reference
from tests.paged.test_attention_features import FEATURES, TOL, make_case, resolve
from tests.paged.test_paged_attention import FP8, check_close, make_inputs, ref_kwargs

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))


def bf16_dots() -> bool:
    """Whether this host's oneDNN multiplies bf16 with the CPU's own bf16 instructions (AVX512-BF16 or AMX-BF16 among
    the CPU's flags) and no ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA caps it: where the GEMM path takes its bf16 form."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA"):
        return False
    return bool(set(native._cpu_flags().split()) & {"avx512_bf16", "amx_bf16"})


def gemm_calls(fn):
    """(result of fn(), number of GEMM-path passes (a work item's KV range) it ran)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, sum(e.count for e in prof.key_averages() if e.key.startswith("kvops::paged_attention::gemm_path"))


@unittest.skipUnless(HAS_COMPILER, "no C++ compiler on this machine: the composite fallback is what runs")
class TestGemmPath(unittest.TestCase):
    def setUp(self):
        self.assertTrue(native.available())

    def check(self, q, k_cache, v_cache, cu, lens, table, kw, dtype, layout="NHD", gemm=True):
        nhd = (k_cache, v_cache) if layout == "NHD" else (k_cache.transpose(1, 2), v_cache.transpose(1, 2))
        want, want_lse = reference(q, *nhd, cu, lens, table, **kw)
        (out, lse), calls = gemm_calls(lambda: kvops.paged_attention(
            q, k_cache, v_cache, cu, lens, table, int((cu[1:] - cu[:-1]).max()), return_lse=True, kv_layout=layout,
            **kw))
        self.assertEqual(calls > 0, gemm, f"GEMM calls: {calls}")
        torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=0)
        torch.testing.assert_close(lse.double(), want_lse, atol=TOL[dtype] * 4, rtol=0)

    def test_every_feature_gqa_5_head_dim_80(self):
        # 40 and 9 queries x GQA 5 = 200 / 45 rows: the GEMM path; a decode row in the same batch takes the other
        for i, kw in enumerate(FEATURES):
            with self.subTest(kw=kw):
                q, kc, vc, cu, lens, table = make_case(i, q_lens=(40, 1, 9), seq_lens=(90, 40, 53), width=8)
                self.check(q, kc, vc, cu, lens, table, resolve(kw, 3, 5, i), torch.float32)

    def test_block_size_1_bf16_fp16_hnd_gqa_7(self):
        for i, kw in enumerate(FEATURES[::3]):
            for block_size, dtype, layout, (h_q, h_kv), d in ((1, torch.float32, "NHD", (7, 1), 16),
                                                                (16, torch.bfloat16, "HND", (14, 2), 64),
                                                                (16, torch.float16, "NHD", (8, 8), 32)):
                with self.subTest(kw=kw, block_size=block_size, dtype=dtype, layout=layout):
                    width = 96 // block_size if block_size > 1 else 96
                    q, kc, vc, cu, lens, table = make_case(i, block_size=block_size, h_q=h_q, h_kv=h_kv, d=d,
                                                           dtype=dtype, width=width, layout=layout,
                                                           q_lens=(33, 0, 12), seq_lens=(90, 5, 53))
                    self.check(q, kc, vc, cu, lens, table, resolve(kw, 3, h_q, i), dtype, layout)

    def test_tiles_of_a_long_prefill_with_threads(self):
        # 700 cached + 300 new tokens: several KV tiles (512 positions) and query items, one and two threads
        q, kc, vc, cu, lens, table = make_case(3, batch=1, q_lens=(300,), seq_lens=(1000,), width=63, h_q=4, h_kv=2,
                                               d=64, dtype=torch.bfloat16)
        old = torch.get_num_threads()
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for kw in (dict(), dict(window_left=600, softcap=30.0), dict(sink_tokens=4, window_left=300)):
                    with self.subTest(threads=threads, kw=kw):
                        self.check(q, kc, vc, cu, lens, table, kw, torch.bfloat16)
        finally:
            torch.set_num_threads(old)

    def test_sub_tiles_skip_and_share_kv_tiles(self):
        # a 600-token prompt with nothing cached, GQA 2: items of 600 rows go through the GEMMs 256 rows at a time;
        # causal, windowed and streaming rows see different KV tiles (512 positions), so sub-tiles skip tiles their
        # rows never see while sharing the gathered ones; fp32 and bf16 forms, one and two threads
        old = torch.get_num_threads()
        self.addCleanup(torch.set_num_threads, old)
        for dtype in (torch.float32, torch.bfloat16):
            q, kc, vc, cu, lens, table = make_case(21, batch=1, q_lens=(600,), seq_lens=(600,), width=40, h_q=4,
                                                   h_kv=2, d=32, dtype=dtype)
            for kw in ({}, dict(window_left=100), dict(sink_tokens=4, window_left=200), dict(causal=False)):
                want, want_lse = reference(q, kc, vc, cu, lens, table, **kw)
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    with self.subTest(dtype=dtype, threads=threads, kw=kw):
                        (out, lse), calls = gemm_calls(lambda: kvops.paged_attention(
                            q, kc, vc, cu, lens, table, 600, return_lse=True, **kw))
                        self.assertGreater(calls, 0)
                        torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=0)
                        torch.testing.assert_close(lse.double(), want_lse, atol=TOL[dtype] * 4, rtol=0)

    def test_sub_tile_columns_odd_shapes(self):
        # each 256-row sub-tile multiplies only the columns of a KV tile its rows see (from the window's start to the
        # causal diagonal, in multiples of 64): GQA 7, head_dim 80, tiles whose length is no multiple of 16 (600 =
        # 512 + 88, 700 = 512 + 188 positions), the prompt's diagonal crossing sub-tiles, windows starting inside a
        # tile, sink tokens
        for dtype in (torch.float32, torch.bfloat16):
            q, kc, vc, cu, lens, table = make_case(22, batch=2, q_lens=(600, 37), seq_lens=(600, 700), width=48,
                                                   h_q=7, h_kv=1, d=80, dtype=dtype)
            for kw in ({}, dict(window_left=100), dict(sink_tokens=4, window_left=37), dict(softcap=20.0)):
                with self.subTest(dtype=dtype, kw=kw):
                    self.check(q, kc, vc, cu, lens, table, kw, dtype)

    def test_fp8_caches_joint_and_padded_layouts_sinks(self):
        # the shared matrix's inputs: NaN in every unused slot and unreferenced block, fp8 with per-KV-head scales
        for layout, cache_dtype, extra in (("joint", None, {}), ("padded", None, dict(window_left=20)),
                                           ("separate", FP8, dict(softcap=10.0)), ("outer", FP8, {})):
            with self.subTest(layout=layout, cache_dtype=cache_dtype):
                inputs = make_inputs(7, [129, 40, 0], [40, 17, 0], block_size=16, h_q=14, h_kv=2, d=64,
                                     layout=layout, cache_dtype=cache_dtype, scale_per_head=cache_dtype is not None,
                                     sinks=True)
                (out, lse), calls = gemm_calls(lambda: kvops.paged_attention(**inputs, **extra, return_lse=True))
                self.assertGreater(calls, 0)
                from tests.paged.test_paged_attention import reference as matrix_reference
                check_close(self, out, lse, *matrix_reference(**ref_kwargs(inputs, **extra)), inputs["q"].dtype)

    def test_custom_mask_both_forms(self):
        from kvops.custom_mask import packbits

        q, kc, vc, cu, lens, table = make_case(11, q_lens=(24, 1, 30), seq_lens=(60, 40, 53), width=8, h_q=4, h_kv=2,
                                               d=32)
        g = torch.Generator().manual_seed(0)
        blocks = [torch.rand(n, n, generator=g) < 0.5 for n in (24, 1, 30)]
        for blk in blocks:
            blk.fill_diagonal_(True)
        flat = torch.cat([b.flatten() for b in blocks])
        packed = torch.cat([packbits(b.flatten()) for b in blocks])
        want = reference(q, kc, vc, cu, lens, table, custom_mask=flat)
        for name, mask in (("custom_mask", flat), ("packed_custom_mask", packed)):
            with self.subTest(form=name):
                (out, lse), calls = gemm_calls(lambda: kvops.paged_attention(
                    q, kc, vc, cu, lens, table, 30, return_lse=True, **{name: mask}))
                self.assertGreater(calls, 0)
                torch.testing.assert_close(out.double(), want[0], atol=2e-5, rtol=0)
                torch.testing.assert_close(lse.double(), want[1], atol=8e-5, rtol=0)

    def test_nan_query_row_is_nan_and_others_are_not(self):
        # a visible key's NaN score makes that row NaN (as SDPA's), on the GEMM path too; other rows are unaffected
        q, kc, vc, cu, lens, table = make_case(12, q_lens=(40, 1, 9), seq_lens=(90, 40, 53), width=8)
        q = q.clone()
        q[5, 2, 7] = float("nan")
        (out, lse), calls = gemm_calls(lambda: kvops.paged_attention(q, kc, vc, cu, lens, table, 40, return_lse=True))
        self.assertGreater(calls, 0)
        self.assertTrue(out[5, 2].isnan().all() and lse[2, 5].isnan())
        out[5, 2] = 0
        lse[2, 5] = 0
        self.assertTrue(torch.isfinite(out).all())
        self.assertTrue(torch.isfinite(lse[:, :40]).all())

    def test_overflowing_scaled_scores_are_nan_never_zero(self):
        # a finite scale whose scaled scores overflow fp32 (+inf) gives NaN rows, as the decode rows and SDPA's fp32
        # math do, never the zeros and -inf LSE of "no keys": every form, including rows that see a whole KV tile
        # unmasked (non-causal: every row's range is the whole 512-position tile), whose max is read from the unscaled
        # scores
        for dtype in (torch.bfloat16, torch.float32):
            with self.subTest(dtype=dtype):
                q, kc, vc, cu, lens, table = make_case(15, q_lens=(64,), seq_lens=(512,), batch=1, width=32, h_q=2,
                                                       h_kv=2, d=64, dtype=dtype)
                q = q.abs() + 1  # every score of a visible key > 0
                kc, vc = kc.abs() + 1, vc.abs() + 1
                for big in (1e37, 3e38):
                    (out, lse), calls = gemm_calls(lambda: kvops.paged_attention(
                        q, kc, vc, cu, lens, table, 64, scale=big, causal=False, return_lse=True))
                    self.assertGreater(calls, 0)
                    self.assertTrue(out.isnan().all(), f"scale {big}: {out.isnan().sum()} NaN of {out.numel()}")
                    self.assertTrue(lse.isnan().all())
                    decode, decode_lse = kvops.paged_attention(q[:1], kc, vc, torch.tensor([0, 1], dtype=torch.int32),
                                                               lens, table, 1, scale=big, causal=False,
                                                               return_lse=True)
                    self.assertTrue(decode.isnan().all() and decode_lse.isnan().all())

    def test_bf16_form_follows_the_mkldnn_switch(self):
        # the bf16 (VNNI, brgemm) form runs where oneDNN packs bf16 (AMX) or the CPU has AVX512-BF16 dot products, and
        # torch.backends.mkldnn is enabled; with it disabled the same call takes the fp32 form (never the brgemm call
        # that would refuse it)
        q, kc, vc, cu, lens, table = make_case(14, q_lens=(40, 9), seq_lens=(90, 53), batch=2, width=8, h_q=4,
                                               h_kv=2, d=64, dtype=torch.bfloat16)
        want, _ = reference(q, kc, vc, cu, lens, table)
        before = torch.backends.mkldnn.enabled
        self.addCleanup(setattr, torch.backends.mkldnn, "enabled", before)
        for enabled in (True, False, True):  # and back: a refusal while disabled is not remembered
            with self.subTest(mkldnn=enabled):
                torch.backends.mkldnn.enabled = enabled
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    out = kvops.paged_attention(q, kc, vc, cu, lens, table, 40)
                names = {e.key for e in prof.key_averages() if e.key.startswith("kvops::paged_attention::gemm_path")}
                form = "cache dtype" if enabled and bf16_dots() else "fp32"
                self.assertEqual(names, {f"kvops::paged_attention::gemm_path({form})"})
                torch.testing.assert_close(out.double(), want, atol=TOL[torch.bfloat16], rtol=0)

    def test_bf16_form_with_onednn_capped_at_avx2(self):
        # ONEDNN_MAX_CPU_ISA=AVX2 (paged_decode.py --emulate-avx2) makes brgemm refuse the VNNI form even on a host
        # with AVX512-BF16: the call takes the fp32 form and answers as the oracle does, never raising
        code = (
            "import torch, kvops\n"
            "from torch.profiler import profile, ProfilerActivity\n"
            "from tests.paged.test_attention_features import make_case\n"
            "from kvops.reference.attention import reference\n"
            "q, kc, vc, cu, lens, table = make_case(14, q_lens=(40,), seq_lens=(90,), batch=1, width=8, h_q=4, h_kv=2,"
            " d=64, dtype=torch.bfloat16)\n"
            "with profile(activities=[ProfilerActivity.CPU]) as prof:\n"
            "    out = kvops.paged_attention(q, kc, vc, cu, lens, table, 40)\n"
            "want, _ = reference(q, kc, vc, cu, lens, table)\n"
            "print(sorted(e.key for e in prof.key_averages() if e.key.startswith('kvops::paged_attention::gemm')),"
            " float((out.double() - want).abs().max()))\n")
        env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                             timeout=300)
        self.assertEqual(res.returncode, 0, res.stderr[-2000:])
        names, err = res.stdout.strip().rsplit(" ", 1)
        self.assertEqual(names, "['kvops::paged_attention::gemm_path(fp32)']")
        self.assertLessEqual(float(err), TOL[torch.bfloat16])

    def test_decode_rows_take_the_register_kernel(self):
        q, kc, vc, cu, lens, table = make_case(13, q_lens=(1, 1, 1), h_q=14, h_kv=2, d=64)
        self.check(q, kc, vc, cu, lens, table, {}, torch.float32, gemm=False)


if __name__ == "__main__":
    unittest.main()

"""The bf16 forms of the native register kernel: bf16 caches read in place with head_dim % 32 == 0 read K and V as
32-bit words (two dims each), through kvops/native/chunk_pairs.h (fp32 FMAs; accumulators in an even/odd layout while a
pass runs) or, where the build has AVX512-BF16, through the bf16 dot products of kvops/native/chunk_dot.h (vdpbf16ps; P
rounded to bf16; an interleaved layout), chosen per call (AMD CPUs: dot products; ``KVOPS_NATIVE_BF16_DOT`` 1 / 0
forces either). Every test runs for both forms (TestBf16WordForm, TestBf16DotForm; on a build without AVX512-BF16 the
second runs the word form again). Every feature they serve, every row block (GQA 1, 2, 3, 4, 5, 7, 8), both layouts,
joint and padded caches with NaN in unused slots, block_size 1, split-KV with two threads and a streaming sink pass
before the window pass (the layout must survive between passes) are checked against the fp64 oracle
(kvops/reference/attention.py). head_dim 80 and RoPE at read keep the fp32 form in the same calls' neighbours (they are
checked by the other native tests)."""

from __future__ import annotations

import os
import pathlib
import shutil
import unittest
from unittest import mock

import expecttest
import torch

import kvops
import kvops.native as native
from kvops.reference.attention import reference
from tests.paged.test_attention_features import FEATURES, TOL, make_case, resolve
from tests.paged.test_native_paged_attention import rising_scores
from tests.paged.test_paged_attention import check_close, make_inputs, ref_kwargs
from tests.paged.test_paged_attention import reference as matrix_reference

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
BF16 = torch.bfloat16
NO_ROPE = [kw for kw in FEATURES if "rope_theta" not in kw]


@unittest.skipUnless(HAS_COMPILER, "no C++ compiler on this machine: the composite fallback is what runs")
class TestBf16WordForm(unittest.TestCase):
    FORM = "0"  # KVOPS_NATIVE_BF16_DOT: chunk_pairs.h

    def setUp(self):
        self.assertTrue(native.available())
        env = mock.patch.dict(os.environ, {"KVOPS_NATIVE_BF16_DOT": self.FORM})
        env.start()
        self.addCleanup(env.stop)

    def check(self, q, k_cache, v_cache, cu, lens, table, kw, layout="NHD"):
        nhd = (k_cache, v_cache) if layout == "NHD" else (k_cache.transpose(1, 2), v_cache.transpose(1, 2))
        want, want_lse = reference(q, *nhd, cu, lens, table, **kw)
        out, lse = kvops.paged_attention(q, k_cache, v_cache, cu, lens, table, int((cu[1:] - cu[:-1]).max()),
                                         return_lse=True, kv_layout=layout, **kw)
        torch.testing.assert_close(out.double(), want, atol=TOL[BF16], rtol=0)
        torch.testing.assert_close(lse.double(), want_lse, atol=TOL[BF16], rtol=0)

    def test_every_feature_every_row_block(self):
        # decode and short extends (rows = q_len x G < 32: the register kernel); G = 7: a block of 7 rows
        for i, kw in enumerate(NO_ROPE):
            for h_q, h_kv, d in ((7, 1, 64), (10, 2, 96), (4, 4, 128), (6, 2, 32), (8, 1, 64), (16, 4, 64)):
                with self.subTest(kw=kw, h_q=h_q, h_kv=h_kv, d=d):
                    q, kc, vc, cu, lens, table = make_case(i, h_q=h_q, h_kv=h_kv, d=d, dtype=BF16, q_lens=(1, 2, 3))
                    self.check(q, kc, vc, cu, lens, table, resolve(kw, 3, h_q, i))

    def test_block_size_1_and_hnd(self):
        for i, kw in enumerate(NO_ROPE[::2]):
            for block_size, layout in ((1, "NHD"), (16, "HND"), (1, "HND")):
                with self.subTest(kw=kw, block_size=block_size, layout=layout):
                    width = 96 // block_size
                    q, kc, vc, cu, lens, table = make_case(i, block_size=block_size, h_q=14, h_kv=2, d=64, dtype=BF16,
                                                           width=width, layout=layout, q_lens=(1, 1, 2),
                                                           seq_lens=(90, 5, 53))
                    self.check(q, kc, vc, cu, lens, table, resolve(kw, 3, 14, i), layout)

    def test_joint_padded_outer_caches_nan_in_unused_slots(self):
        for layout in ("joint", "padded", "outer", "separate"):
            for extra in ({}, dict(window_left=20, softcap=10.0)):
                with self.subTest(layout=layout, extra=extra):
                    inputs = make_inputs(7, [129, 40, 0, 1], [1, 1, 0, 1], block_size=16, h_q=14, h_kv=2, d=64,
                                         dtype=BF16, layout=layout, sinks=True)
                    out, lse = kvops.paged_attention(**inputs, **extra, return_lse=True)
                    check_close(self, out, lse, *matrix_reference(**ref_kwargs(inputs, **extra)), BF16)

    def test_chunk_edges(self):
        # on AVX-512 a chunk is 32 tokens (two 16-lane halves, one online-softmax step): lengths on both sides of
        # 16 / 32 multiples, windows that leave one half or a single lane visible, a sink pass ending mid-chunk
        for i, kw in enumerate(({}, dict(window_left=0), dict(window_left=5), dict(window_left=20),
                                dict(sink_tokens=3, window_left=17), dict(causal=False, window_right=0, window_left=0))):
            for seq in (1, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 97):
                with self.subTest(kw=kw, seq=seq):
                    q, kc, vc, cu, lens, table = make_case(i + seq, h_q=14, h_kv=2, d=64, dtype=BF16,
                                                           q_lens=(1, 2, 1), seq_lens=(seq, max(seq - 3, 2), seq + 5),
                                                           width=7)
                    self.check(q, kc, vc, cu, lens, table, kw)

    def test_nan_key_alone_in_its_chunk(self):
        # a NaN key that is the only visible lane of its 32-token chunk (window_left=0) makes the query's output
        # and LSE NaN, as SDPA's; the other sequences are untouched
        for seq in (1, 17, 32, 33, 50):
            with self.subTest(seq=seq):
                q, kc, vc, cu, lens, table = make_case(seq, h_q=7, h_kv=1, d=64, dtype=BF16, q_lens=(1, 1, 1),
                                                       seq_lens=(seq, 40, 9), width=7)
                pos = seq - 1  # the query's own position: the one key it sees
                kc[table[0, pos // 16], pos % 16] = float("nan")
                out, lse = kvops.paged_attention(q, kc, vc, cu, lens, table, 1, window_left=0, return_lse=True)
                self.assertTrue(out[0].isnan().all() and lse[:, 0].isnan().all())
                want, want_lse = reference(q[1:], kc, vc, cu[1:] - 1, lens[1:], table[1:], window_left=0)
                torch.testing.assert_close(out[1:].double(), want, atol=TOL[BF16], rtol=0)
                torch.testing.assert_close(lse[:, 1:].double(), want_lse, atol=TOL[BF16], rtol=0)

    def test_running_max_rising_by_less_and_more_than_the_slack(self):
        # as tests/paged/test_native_paged_attention.py's test of the same name, in bf16 (P rounded to bf16 in the
        # dot form, its values up to 256 there)
        profiles = dict(slow=lambda j: 0.02 * j, fast=lambda j: 0.4 * j, jump=lambda j: 40.0 * (j >= 150),
                        falling=lambda j: -0.3 * j, steps=lambda j: 5.4 * (j // 32), big_steps=lambda j: 7.9 * (j // 32))
        for name, profile in profiles.items():
            for h_q in (7, 4):
                with self.subTest(profile=name, h_q=h_q):
                    inputs = rising_scores(len(name), profile, BF16, h_q=h_q)
                    out, lse = kvops.paged_attention(**inputs, return_lse=True)
                    check_close(self, out, lse, *matrix_reference(**ref_kwargs(inputs)), BF16)

    def test_value_head_dim_differs(self):
        # head_dim_v != head_dim (MLA-style values): K and V words are read with their own widths
        for d, d_v in ((64, 32), (32, 96), (128, 64)):
            with self.subTest(d=d, d_v=d_v):
                inputs = make_inputs(9, [70, 33, 1], [1, 2, 1], block_size=16, h_q=7, h_kv=1, d=d, d_v=d_v,
                                     dtype=BF16, sinks=True)
                out, lse = kvops.paged_attention(**inputs, return_lse=True)
                check_close(self, out, lse, *matrix_reference(**ref_kwargs(inputs)), BF16)

    def test_split_kv_and_sink_pass_with_threads(self):
        # one long sequence: split along its KV range (merged afterwards) with two threads; the streaming sink pass
        # runs before the window pass on the same accumulators
        q, kc, vc, cu, lens, table = make_case(3, batch=1, q_lens=(1,), seq_lens=(3000,), width=190, h_q=14, h_kv=2,
                                               d=64, dtype=BF16)
        old = torch.get_num_threads()
        self.addCleanup(torch.set_num_threads, old)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for kw in ({}, dict(sink_tokens=4, window_left=1000), dict(softcap=30.0, window_left=2500)):
                with self.subTest(threads=threads, kw=kw):
                    self.check(q, kc, vc, cu, lens, table, kw)


@unittest.skipUnless(HAS_COMPILER, "no C++ compiler on this machine: the composite fallback is what runs")
class TestBf16DotForm(TestBf16WordForm):
    FORM = "1"  # chunk_dot.h where the build has AVX512-BF16 (else chunk_pairs.h again)


def _amd() -> bool:
    info = pathlib.Path("/proc/cpuinfo")
    return info.exists() and "AuthenticAMD" in info.read_text()


@unittest.skipUnless(HAS_COMPILER, "no C++ compiler on this machine: the composite fallback is what runs")
class TestBf16FormChoice(expecttest.TestCase):
    def run_form(self, form, inputs):
        with mock.patch.dict(os.environ, {"KVOPS_NATIVE_BF16_DOT": form}):
            if not form:
                del os.environ["KVOPS_NATIVE_BF16_DOT"]
            return kvops.paged_attention(**inputs, return_lse=True)

    def test_the_variable_picks_the_form_and_the_default_follows_the_vendor(self):
        self.assertTrue(native.available())
        inputs = make_inputs(5, [700, 33, 1], [1, 1, 1], block_size=16, h_q=7, h_kv=1, d=64, dtype=BF16)
        words, dots, default = (self.run_form(f, inputs) for f in ("0", "1", ""))
        has_dot = native.isa_macros()["__AVX512BF16__"]
        # the forms round differently (P in bf16): their outputs differ where the build has both, and are one where not
        self.assertEqual(torch.equal(words[0], dots[0]), not has_dot)
        want = dots if has_dot and _amd() else words
        self.assertTrue(torch.equal(default[0], want[0]) and torch.equal(default[1], want[1]))
        for out, lse in (words, dots):
            check_close(self, out, lse, *matrix_reference(**ref_kwargs(inputs)), BF16)

    def test_a_bad_value_raises_in_eager_and_compiled_calls(self):
        self.assertTrue(native.available())
        inputs = make_inputs(5, [40, 3], [1, 1], block_size=16, h_q=7, h_kv=1, d=64, dtype=torch.float32)
        compiled = torch.compile(lambda i: kvops.paged_attention(**i), fullgraph=True)
        for run in (lambda: kvops.paged_attention(**inputs), lambda: compiled(inputs)):
            with mock.patch.dict(os.environ, {"KVOPS_NATIVE_BF16_DOT": "yes"}), self.assertRaises(ValueError) as cm:
                run()
            self.assertExpectedInline(str(cm.exception).splitlines()[0], """\
KVOPS_NATIVE_BF16_DOT='yes' is not a form of the native bf16 decode; set it to 1 (bf16 dot products, vdpbf16ps, where the build has AVX512-BF16), 0 (the word form: fp32 FMAs) or unset it (the default: dot products on AMD CPUs)""")


if __name__ == "__main__":
    unittest.main()

"""The native C++ CPU kernel of kvops.paged_attention (kvops/native/): it is built and used, its own code paths
(split-KV with several threads, the staging path for odd head_dim / strided rows, HND views) against the fp64
reference of tests/paged/test_paged_attention.py, the composite fallback (same results, one warning on a failed build),
compiled graphs calling it, and no recompiles as the context grows from 16 to 8192 tokens.

The sampled matrix in tests/paged/test_paged_attention.py already runs against the native kernel (it is what
``kvops.paged_attention`` calls on CPU once built).
"""

from __future__ import annotations

import importlib
import math
import pathlib
import shutil
import unittest
import warnings
from contextlib import contextmanager
from unittest import mock

import torch
import torch._dynamo.testing

import kvops
import kvops.native as native
import kvops.cpu.paged_attention as composite
from tests.contract import OpLog
from tests.paged.test_paged_attention import FP8, check_close, make_inputs, ref_kwargs, reference

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
ARGS = ("q", "k_cache", "v_cache", "cu_seqlens_q", "seq_lens", "block_table")


@contextmanager
def num_threads(n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextmanager
def native_state(value):
    old = native._state
    native._state = value
    try:
        yield
    finally:
        native._state = old


def run_and_check(test, inputs, **options):
    out, lse = kvops.paged_attention(**inputs, **options, return_lse=True)
    check_close(test, out, lse, *reference(**ref_kwargs(inputs, **options)), inputs["q"].dtype)
    return out, lse


def rising_scores(seed, profile, dtype, seq_len=300, h_q=7, d=64):
    """Decode inputs whose scores follow ``profile`` (a function of the KV position, one sequence of ``seq_len``
    tokens, one KV head): each key is a multiple of the group's mean query, so every query row's scores are a
    (row-dependent, mostly positive) multiple of the profile. The online softmax's running max then rises by less,
    or by more, than the kernel's rescale slack per chunk."""
    inputs = make_inputs(seed, [seq_len], [1], block_size=16, h_q=h_q, h_kv=1, d=d, dtype=dtype)
    scale = d**-0.5
    qm = inputs["q"][0].double().mean(0)
    table = inputs["block_table"][0]
    for j in range(seq_len):
        inputs["k_cache"][table[j // 16], j % 16, 0] = (profile(j) / scale * qm / qm.dot(qm)).to(dtype)
    return inputs


@unittest.skipUnless(HAS_COMPILER, "no C++ compiler on this machine: the composite fallback is what runs")
class TestNativeKernel(unittest.TestCase):
    def test_lazy_rescale_keeps_huge_values_finite(self):
        # one key 7.5 / 5 above the others' scores in a later chunk, its V row 2e35 (a new user's finding: with a
        # slack of 8 its weight e^7.5 took the accumulator past the fp32 range). The slack is ln 256: a weight stays
        # below 256, so one dominant key's V row stays finite up to the fp32 maximum / 256, in fp32 and bf16 (both
        # forms); the general limit is |out| x l (docs/native-kernel.md, "Lazy rescale")
        for dtype in (torch.float32, torch.bfloat16):
            for form in ("0", "1") if dtype == torch.bfloat16 else ("",):  # KVOPS_NATIVE_BF16_DOT: bf16's two forms
                for bump in (7.5, 5.0):
                    with self.subTest(dtype=dtype, form=form, bump=bump), \
                            mock.patch.dict("os.environ", {"KVOPS_NATIVE_BF16_DOT": form}):
                        q = torch.zeros(1, 1, 64, dtype=dtype)
                        q[0, 0, 0] = 8.0  # scale 1/8: score = k[0]
                        k = torch.zeros(128, 1, 1, 64, dtype=dtype)
                        k[100, 0, 0, 0] = bump
                        v = torch.zeros(128, 1, 1, 64, dtype=dtype)
                        v[100] = 2e35
                        args = (q, k, v, torch.tensor([0, 1], dtype=torch.int32),
                                torch.tensor([128], dtype=torch.int32), torch.arange(128, dtype=torch.int32)[None], 1)
                        out = kvops.paged_attention(*args)
                        want = 2e35 * math.exp(bump) / (127 + math.exp(bump))
                        self.assertTrue(torch.isfinite(out).all(), out[0, 0, :4])
                        torch.testing.assert_close(out[0, 0].double(), torch.full((64,), want, dtype=torch.double),
                                                   rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=0)

    def test_running_max_rising_by_less_and_more_than_the_slack(self):
        # the running max is raised only when a score passes it by more than ln 256 (attend_regs.h: RESCALE_SLACK):
        # slow rises (stale max for several chunks), fast rises (raised every chunk), a jump of 40, falling scores,
        # steps of 5.4 per chunk (just under the slack) and 7.9
        profiles = dict(slow=lambda j: 0.02 * j, fast=lambda j: 0.4 * j, jump=lambda j: 40.0 * (j >= 150),
                        falling=lambda j: -0.3 * j, steps=lambda j: 5.4 * (j // 32), big_steps=lambda j: 7.9 * (j // 32))
        for dtype in (torch.float32, torch.float16):
            for name, profile in profiles.items():
                with self.subTest(dtype=dtype, profile=name):
                    run_and_check(self, rising_scores(len(name), profile, dtype))
                    run_and_check(self, rising_scores(len(name), profile, dtype), window_left=100)

    def test_fp16_caches(self):
        # fp16 K/V converted 16 (or NW) values at a time (vec.h: half16 / half_nw): rows read in place (head_dim 64,
        # 128), staged rows of head_dim 80 (5 full vectors) and 72 (4 and a tail), GQA 5:1 and 7:1, block_size 1, a
        # zero-length sequence, decode and several query rows
        cases = [dict(h_q=14, h_kv=2, d=64, block_size=16), dict(h_q=8, h_kv=2, d=128, block_size=16),
                 dict(h_q=5, h_kv=1, d=80, block_size=1), dict(h_q=7, h_kv=1, d=72, block_size=16)]
        for i, case in enumerate(cases):
            with self.subTest(**case):
                run_and_check(self, make_inputs(40 + i, [300, 0, 45], [1, 1, 3], dtype=torch.float16, **case))

    def test_built_once_cached_and_used(self):
        self.assertTrue(native.available())
        build_dir = pathlib.Path(torch.utils.cpp_extension._get_build_directory(native.build_name(), False))
        self.assertTrue((build_dir / f"{native.build_name()}.so").exists())  # later processes load this file
        inputs = make_inputs(3, [40, 1, 0, 17], [1, 1, 1, 3], block_size=16, h_q=14, h_kv=2, d=64)
        out, lse = kvops.paged_attention(**inputs, return_lse=True)
        direct = torch.ops.kvops._paged_attention_native(
            *(inputs[k] for k in ARGS), inputs["max_seqlen_q"], 64**-0.5, True, -1, 0.0, None, None, None)
        self.assertTrue(torch.equal(out, direct[0]) and torch.equal(lse, direct[1]))

    def test_split_kv_with_threads(self):
        # one or two sequences and 4 threads: the KV range is split into parts and merged
        with num_threads(4):
            for dtype in (torch.float32, torch.bfloat16):
                inputs = make_inputs(1, [3000], [1], block_size=16, h_q=14, h_kv=2, d=64, dtype=dtype, sinks=True)
                run_and_check(self, inputs)
                run_and_check(self, inputs, window_left=700, softcap=20.0)
            inputs = make_inputs(2, [2600, 5], [1, 1], block_size=16, h_q=8, h_kv=2, d=128, cache_dtype=FP8,
                                 scale_per_head=True)
            run_and_check(self, inputs, window_left=1000)

    def test_staging_path_odd_head_dim_and_strided_rows(self):
        # head_dim 72 / 40 (not multiples of 16), a last-dim stride != 1, GQA 5:1 and 7:1
        run_and_check(self, make_inputs(4, [300, 17, 1], [3, 1, 1], block_size=16, h_q=5, h_kv=1, d=72, d_v=40))
        inputs = make_inputs(5, [129, 16, 2], [17, 1, 2], block_size=16, h_q=14, h_kv=2, d=32,
                             dtype=torch.float16)
        for name in ("k_cache", "v_cache"):
            c = inputs[name]
            inputs[name] = c.transpose(-1, -2).contiguous().transpose(-1, -2)  # [P, bs, H_kv, D] with stride (.., 1, H)
            self.assertNotEqual(inputs[name].stride(-1), 1)
        run_and_check(self, inputs, softcap=5.0)

    def test_hnd_view_of_the_cache(self):
        # an HND allocation [P, H_kv, bs, D] seen as NHD (what kv_layout="HND" passes down): strides only
        inputs = make_inputs(6, [70, 33, 0], [1, 17, 1], block_size=16, h_q=28, h_kv=4, d=64, dtype=torch.bfloat16,
                             sinks=True)
        for name in ("k_cache", "v_cache"):
            inputs[name] = inputs[name].transpose(1, 2).contiguous().transpose(1, 2)
        run_and_check(self, inputs, window_left=20)

    def test_row_blocks_for_every_gqa_ratio(self):
        # a KV head's rows (q_len x GQA group) run in one block of 1-8 rows (no padding) or blocks of 8: every ratio
        # and query count, contexts long enough for the prefetch to run ahead across blocks (block_size 5: runs cross
        # block boundaries)
        for i, (h_q, q_lens) in enumerate(((2, [1, 3, 2]), (4, [1, 3, 1]), (6, [1, 1, 2]), (8, [1, 1, 1]),
                                           (10, [1, 2, 1]), (16, [1, 9, 1]), (14, [1, 1, 2]), (12, [1, 2, 1]))):
            with self.subTest(gqa=h_q // 2, q_lens=q_lens):
                inputs = make_inputs(20 + i, [700, 37, 2], q_lens, block_size=5 if i % 2 else 16, h_q=h_q, h_kv=2,
                                     d=32, sinks=i == 3)
                run_and_check(self, inputs, window_left=-1 if i % 3 else 600)

    def test_native_value_check_agrees_with_the_torch_check(self):
        # the one-pass native check of the eager CPU path flags exactly the calls the torch check of
        # values_attention.py does
        from kvops._checks import values_attention

        num_blocks, block_size = 6, 4

        def case(cu, lens, table, num_tokens=4, max_q=2):
            cu, lens = torch.tensor(cu, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
            table = torch.tensor(table, dtype=torch.int32)
            return cu, lens, table, num_tokens, max_q

        ok = ([0, 1, 3], [5, 8], [[0, 5, -1], [2, 3, 99]])
        cases = {
            "valid": case(*ok),
            "valid, rows past cu[-1]": case([0, 1, 2], [5, 8], [[0, 5, -1], [2, 3, 99]]),
            "cu_start": case([1, 1, 3], *ok[1:]),
            "cu_order": case([0, 3, 2], *ok[1:]),
            "cu_end": case([0, 1, 5], *ok[1:], num_tokens=4, max_q=4),
            "q_len": case(ok[0], ok[1], ok[2], max_q=1),
            "seq_len negative": case(ok[0], [-1, 8], ok[2]),
            "seq_len past the table": case(ok[0], [5, 13], ok[2]),
            "block negative": case(ok[0], [5, 8], [[0, -1, -1], [2, 3, 99]]),
            "block past P": case(ok[0], [5, 8], [[0, 5, -1], [2, 6, 99]]),
        }
        q = torch.zeros(4, 1, 8)
        # the op below is the build's: load it (run alone, as xdist's default distribution runs it, nothing had)
        self.assertTrue(native.available())
        for name, (cu, lens, table, num_tokens, max_q) in cases.items():
            for strided in (False, True):
                t = table
                if strided:  # a non-contiguous view with the same values
                    t = torch.stack([table, torch.full_like(table, -7)], dim=-1)[..., 0]
                    self.assertFalse(t.is_contiguous())
                with self.subTest(case=name, strided=strided):
                    native_bad = torch.ops.kvops._paged_attention_values_bad(
                        cu, lens, t, num_tokens, max_q, num_blocks, block_size)
                    v = values_attention._attention_violations(q[:num_tokens], num_blocks, block_size, cu, lens, t,
                                                               max_q)
                    self.assertEqual(native_bad, bool(torch.stack([x.any() for x in v.values()]).any()))
                    self.assertEqual(native_bad, not name.startswith("valid"))

    def test_eager_calls_skip_the_dispatcher_only_when_nothing_watches(self):
        op_module = importlib.import_module("kvops.ops.paged_attention")  # (the package re-exports the function)

        inputs = make_inputs(30, [50, 3], [1, 2], block_size=16, h_q=4, h_kv=2, d=16, sinks=True)
        tensors = (*(inputs[k] for k in ARGS), inputs["sinks"])
        self.assertTrue(op_module._direct(tensors))
        direct = kvops.paged_attention(**inputs, window_left=9, return_lse=True)
        dispatched = torch.ops.kvops.paged_attention(*(inputs[k] for k in ARGS), inputs["max_seqlen_q"], None, True,
                                                     9, 0.0, inputs["sinks"], None, None, "NHD")
        self.assertTrue(torch.equal(direct[0], dispatched[0]) and torch.equal(direct[1], dispatched[1]))

        with OpLog() as seen:  # a dispatch mode sees the op itself
            kvops.paged_attention(**inputs)
        self.assertIn("kvops.paged_attention.default", seen.ops)
        q = inputs["q"].clone().requires_grad_()
        self.assertFalse(op_module._direct((q,)))  # autograd: the dispatcher decides
        with torch.no_grad():
            self.assertTrue(op_module._direct((q,)))
        self.assertFalse(op_module._direct((torch.nn.Parameter(q.detach()),)))  # subclasses: the dispatcher
        with torch.profiler.profile() as prof:  # a profile names the op
            kvops.paged_attention(**inputs)
        self.assertIn("kvops::paged_attention", [e.name for e in prof.events()])

    def test_compiled_graph_calls_native_kernel(self):
        torch._dynamo.reset()
        backend = torch._dynamo.testing.AotEagerAndRecordGraphs()
        inputs = make_inputs(7, [33, 5], [3, 1], block_size=16, h_q=4, h_kv=2, d=16)

        @torch.compile(backend=backend, fullgraph=True)
        def f(*a):
            return kvops.paged_attention(*a, 3, window_left=9, return_lse=True)

        args = tuple(inputs[k] for k in ARGS)
        out, lse = f(*args)
        self.assertIn("_paged_attention_native", backend.fw_graphs[0].code)
        want = kvops.paged_attention(*args, 3, window_left=9, return_lse=True)
        self.assertTrue(torch.equal(out, want[0]) and torch.equal(lse, want[1]))

    def test_decode_loop_context_16_to_8192_compiles_at_most_twice(self):
        # block tables widen as the context grows (one block per 16 tokens); the table width and lengths are dynamic
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

        @torch.compile(backend=counter, fullgraph=True)
        def step(*a):
            return kvops.paged_attention(*a, 1, window_left=4000, return_lse=True)

        for n in (16, 100, 700, 3000, 8192):
            inputs = make_inputs(n, [n, n // 2 + 1], [1, 1], block_size=16, h_q=14, h_kv=2, d=64,
                                 dtype=torch.bfloat16)
            args = tuple(inputs[k] for k in ARGS)
            out, lse = step(*args)
            want = kvops.paged_attention(*args, 1, window_left=4000, return_lse=True)
            self.assertTrue(torch.equal(out, want[0]) and torch.equal(lse, want[1]))
        self.assertLessEqual(counter.frame_count, 2)


class TestFallback(unittest.TestCase):
    def test_fallback_is_the_composite_kernel(self):
        inputs = make_inputs(8, [300, 1, 0, 17], [3, 1, 1, 17], block_size=16, h_q=14, h_kv=2, d=64, sinks=True,
                             cache_dtype=FP8, scale_per_head=True)
        with native_state(False):
            out, lse = kvops.paged_attention(**inputs, window_left=50, softcap=10.0, return_lse=True)
        args = tuple(inputs[k] for k in ARGS)
        want = composite.paged_attention(*args, inputs["max_seqlen_q"], 64**-0.5, True, 50, 10.0, inputs["sinks"],
                                         inputs["k_scale"], inputs["v_scale"])
        self.assertTrue(torch.equal(out, want[0]) and torch.equal(lse, want[1]))
        check_close(self, out, lse, *reference(**ref_kwargs(inputs, window_left=50, softcap=10.0)), torch.float32)
        if HAS_COMPILER:  # both kernels compute the same attention
            native_out, native_lse = kvops.paged_attention(**inputs, window_left=50, softcap=10.0, return_lse=True)
            torch.testing.assert_close(native_out, out, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(native_lse, lse, atol=1e-4, rtol=1e-4)

    def test_failed_build_warns_once_and_falls_back(self):
        def no_compiler(**kwargs):
            raise RuntimeError("Error building extension 'kvops_native': c++: command not found\nmore")

        inputs = make_inputs(9, [20], [2], block_size=4)
        with native_state(None), mock.patch("torch.utils.cpp_extension.load", no_compiler):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.assertFalse(native.available())
                out = kvops.paged_attention(**inputs)  # composite, no second warning
                self.assertFalse(native.available())
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        self.assertEqual(len(messages), 1, messages)
        self.assertIn("c++: command not found", messages[0])
        self.assertIn("composite torch kernel", messages[0])
        ref_out, _ = reference(**ref_kwargs(inputs))
        torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=1e-4)

    def test_aot_inductor_compilation_uses_the_composite(self):
        # AOTInductor packages must load in processes without kvops: no native op in their graphs
        from torch._inductor.virtualized import V

        with V.set_aot_compilation(True):
            self.assertFalse(native.use_native())
        self.assertEqual(native.use_native(), native.available())

    def test_opt_out_environment_variable(self):
        with mock.patch.dict("os.environ", {"KVOPS_NATIVE": "0"}), warnings.catch_warnings():
            warnings.simplefilter("error")  # opting out does not warn
            self.assertFalse(native._build())



# --- memory safety of the native kernel: any index values, whatever the value-check mode ------------------------
def _bad_index_cases():
    """(name, cu_seqlens_q, seq_lens, block_table, expected message) for a cache of P = 4 blocks of block_size 4 and a
    block table of 2 columns (capacity 8 tokens), one query row. Each case read (or wrote) out of bounds before the
    fix: a segfault (capacity, 1e8, cu_seqlens_q) or garbage (99, -5)."""
    return [
        ("seq_len past capacity", [0, 1], [9], [[0, 1]],
         "seq_lens[0] = 9 is outside [0, 8], the capacity of block_table"),
        ("block id 1e8", [0, 1], [8], [[0, 100_000_000]],
         "block_table[0, 1] = 100000000 is not a block of the cache: block ids must be in [0, 4) (P = 4 blocks)"),
        ("block id >= P", [0, 1], [8], [[0, 99]], "block_table[0, 1] = 99 is not a block of the cache"),
        ("negative block id", [0, 1], [5], [[-5, 1]], "block_table[0, 0] = -5 is not a block of the cache"),
        ("cu_seqlens_q past T_q", [0, 1000], [8], [[0, 1]],
         "cu_seqlens_q = [0, 1000] must be non-decreasing from 0 to at most q's 1 rows (T_q)"),
        ("negative seq_len", [0, 1], [-3], [[0, 1]], "seq_lens[0] = -3 is outside [0, 8]"),
    ]


@unittest.skipUnless(HAS_COMPILER, "no C++ compiler on this machine: the composite fallback is what runs")
class TestNativeMemorySafety(unittest.TestCase):
    """The native kernel checks the index values it addresses memory with (block ids in use, seq_lens, cu_seqlens_q)
    before any parallel region and raises the value-contract error of docs/semantics.md §7, also where no value check
    runs: value_checks("off") and compiled graphs in the default "eager" mode (which emits no checks in traced code)."""

    def setUp(self):
        self.assertTrue(native.available())
        g = torch.Generator().manual_seed(0)
        self.k = torch.randn(4, 4, 2, 8, generator=g)  # P = 4 blocks of block_size 4, 2 KV heads, head_dim 8
        self.v = torch.randn(4, 4, 2, 8, generator=g)
        self.q = torch.randn(1, 2, 8, generator=g)

    def _cases(self):
        i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        for name, cu, lens, table, message in _bad_index_cases():
            yield name, i32(cu), i32(lens), i32(table), message

    def test_eager_with_checks_off_raises(self):
        with kvops.value_checks("off"):
            for name, cu, lens, table, message in self._cases():
                with self.subTest(case=name), self.assertRaises(RuntimeError) as ctx:
                    kvops.paged_attention(self.q, self.k, self.v, cu, lens, table, max_seqlen_q=1)
                self.assertIn(message, str(ctx.exception))
            i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
            good = kvops.paged_attention(self.q, self.k, self.v, i32([0, 1]), i32([7]), i32([[3, 0]]), max_seqlen_q=1)
        want = kvops.paged_attention(self.q, self.k, self.v, i32([0, 1]), i32([7]), i32([[3, 0]]), max_seqlen_q=1)
        self.assertTrue(torch.equal(good, want))

    def test_compiled_default_mode_raises(self):
        torch._dynamo.reset()
        self.assertEqual(kvops.get_value_checks(), "eager")  # which emits no checks inside traced code
        f = torch.compile(lambda *a: kvops.paged_attention(*a, max_seqlen_q=1), fullgraph=True)
        for name, cu, lens, table, message in self._cases():
            with self.subTest(case=name), self.assertRaises(RuntimeError) as ctx:
                f(self.q, self.k, self.v, cu, lens, table)
            self.assertIn(message, str(ctx.exception))
            with self.assertRaises(RuntimeError) as eager:  # the eager check of kvops/_checks/values_attention.py
                kvops.paged_attention(self.q, self.k, self.v, cu, lens, table, max_seqlen_q=1)
            self.assertEqual(str(ctx.exception), str(eager.exception))  # word for word

    def test_flash_attn_with_kvcache_block_ids(self):
        # its seq_lens clamp keeps positions inside the table; the block ids are what the kernel checks
        q = self.q.view(1, 1, 2, 8)
        lens = torch.tensor([8], dtype=torch.int32)
        f = torch.compile(kvops.flash_attn_with_kvcache, fullgraph=True)
        torch._dynamo.reset()
        for block_id in (100_000_000, 99, -5):
            table = torch.tensor([[0, block_id]], dtype=torch.int32)
            for how in ("off", "compiled"):
                with self.subTest(block_id=block_id, how=how), self.assertRaisesRegex(
                        RuntimeError, rf"block_table\[0, 1\] = {block_id} is not a block of the cache"):
                    if how == "off":
                        with kvops.value_checks("off"):
                            kvops.flash_attn_with_kvcache(q, self.k, self.v, cache_seqlens=lens, block_table=table)
                    else:
                        f(q, self.k, self.v, cache_seqlens=lens, block_table=table)


    def test_packed_int2_cluster_ids_past_the_centroids_raise(self):
        # kvops.packed.PackedKV is a public tuple: int2 cluster ids (uint8) index the segment's C centroids
        from kvops.packed import PackedKV, packed_attention, quantize_kv

        g = torch.Generator().manual_seed(1)
        x = torch.randn(1, 32, 2, 64, generator=g)
        k, v = (quantize_kv(t, "int2", num_clusters=4) for t in (x, x.flip(1)))
        q = torch.randn(1, 1, 4, 64, generator=g)
        good = packed_attention(q, [k], [v])
        for bad_id in (4, 255):
            ids = k.cluster_ids.clone()
            ids[0, 17, 1] = bad_id
            with self.subTest(bad_id=bad_id), self.assertRaisesRegex(
                    RuntimeError, rf"kvops.packed_attention: cluster_ids\[0, 17, 1\] = {bad_id} is not a centroid of "
                                  r"its segment: cluster ids must be in \[0, 4\)"):
                packed_attention(q, [k._replace(cluster_ids=ids)], [v])
        self.assertTrue(torch.equal(packed_attention(q, [k], [v]), good))
        self.assertIsInstance(k, PackedKV)


if __name__ == "__main__":
    unittest.main()

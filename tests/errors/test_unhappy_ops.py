"""Unhappy paths of the ops: no input kills the process, a failing call changes nothing, no silently wrong results.

The generated cases (``tests/unhappy_ops_cases.py``: every public op's arguments in wrong dtypes, ranks, devices,
sizes, zero-size dims, overlapping caches, out-of-range index values, and the private ``torch.ops.kvops._*`` ops;
and ``tests/unhappy_kernels_cases.py``) run in ONE subprocess per source, each case in a forked child, and must all be ``clear``: the documented exception type, a
message naming the argument (and the value), every tensor byte unchanged, no crash, no hang. Below them, the adversarial review's
cases with their messages (expecttest), in eager, compile and export where they are contract errors, and the
behaviours defined here (joint layouts keep working, non-finite quantization, packed attention's backward).
"""

import json
import os
import unittest

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import expecttest  # noqa: E402

import kvops  # noqa: E402
import kvops.export  # noqa: E402
import kvops.packed as kp  # noqa: E402
from tests.contract import raises_everywhere  # noqa: E402
from tests.unhappy import check_failing_call, run_isolated  # noqa: E402
from tests.unhappy_ops_cases import PRIVATE_OPS  # noqa: E402

I32 = torch.int32


class TestGeneratedCases(unittest.TestCase):
    def test_every_generated_case_is_clear(self):
        """(a) documented type + needles, (b) nothing changed, (c) no crash/hang: all cases, one subprocess."""
        proc = run_isolated(
            """
            import json
            from tests.unhappy_ops_cases import run_cases
            print("RESULTS" + json.dumps(run_cases(timeout=120)))
            """,
            timeout=600,
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULTS")), None)
        self.assertIsNotNone(line, proc.stderr[-3000:])
        results = json.loads(line[len("RESULTS"):])
        self.assertGreater(len(results), 200)
        bad = [f"{outcome}: {name}: {detail[:300]}" for name, outcome, detail in results if outcome != "clear"]
        self.assertEqual(bad, [], "\n".join(bad))

    def test_every_kernels_case_is_clear(self):
        """tests/unhappy_kernels_cases.py (sizes near the integer limits, non-finite scalars and data, threads, the
        attention features' and FlashInfer's arguments): every case clear, each in a forked child."""
        proc = run_isolated(
            """
            import json
            from tests.unhappy import cases_of, run_cases
            print("RESULTS" + json.dumps(run_cases(cases_of("tests.unhappy_kernels_cases"), timeout=300)))
            """,
            timeout=900,
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULTS")), None)
        self.assertIsNotNone(line, proc.stderr[-3000:])
        results = json.loads(line[len("RESULTS"):])
        self.assertGreater(len(results), 150)
        bad = [f"{outcome}: {name}: {detail[:300]}" for name, outcome, detail in results if outcome != "clear"]
        self.assertEqual(bad, [], "\n".join(bad))

    def test_every_private_op_has_cases(self):
        """Every ``torch.ops.kvops._*`` op is enumerated (a new one without cases fails here)."""
        import kvops.native

        kvops.native.available()
        found = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("kvops::_")}
        self.assertIn("_paged_write_native", found)
        self.assertEqual(found - set(PRIVATE_OPS), set())


def _paged(block_size=4, heads=2, head_dim=8, blocks=8):
    return torch.zeros(blocks, block_size, heads, head_dim), torch.zeros(blocks, block_size, heads, head_dim)


class TestZeroSizes(expecttest.TestCase):
    """§1: every zero-size dim is a ValueError naming it (in every value-check mode, native or not)."""

    def test_block_size_zero_paged_attention(self):
        kc, vc = _paged(block_size=0)
        q = torch.randn(1, 2, 8)
        cu, lens, table = torch.tensor([0, 1], dtype=I32), torch.tensor([1], dtype=I32), torch.zeros(1, 1, dtype=I32)
        msg = raises_everywhere(self, ValueError, lambda q, kc, vc: kvops.paged_attention(q, kc, vc, cu, lens, table, 1),
                                (q, kc, vc))
        self.assertExpectedInline(msg, """kvops.paged_attention: k_cache has block_size = 0 (shape (8, 0, 2, 8) read as [num_blocks, block_size, num_kv_heads, head_dim]); a paged cache needs block_size >= 1. Allocate the cache with at least one row per block.""")  # noqa: B950
        for mode in ("off", "async"):
            with kvops.value_checks(mode), self.subTest(mode=mode):
                with self.assertRaisesRegex(ValueError, "block_size = 0"):
                    kvops.paged_attention(q, kc, vc, cu, lens, table, 1)

    def test_zero_heads_and_head_dim(self):
        cu, lens, table = torch.tensor([0, 1], dtype=I32), torch.tensor([1], dtype=I32), torch.zeros(1, 1, dtype=I32)
        kc, vc = _paged(heads=0)
        with self.assertRaisesRegex(ValueError, "num_kv_heads = 0"):
            kvops.paged_attention(torch.randn(1, 0, 8), kc, vc, cu, lens, table, 1)
        kc, vc = _paged(head_dim=0)
        with self.assertRaisesRegex(ValueError, "head_dim = 0"):
            kvops.paged_attention(torch.randn(1, 2, 0), kc, vc, cu, lens, table, 1)
        msg = check_failing_call(self, lambda: kp.packed_attention(torch.randn(1, 2, 0, 16), [torch.randn(1, 4, 0, 16)],
                                                                   [torch.randn(1, 4, 0, 16)]), ValueError,
                                 ["num_kv_heads"])
        self.assertExpectedInline(msg, """kvops.packed_attention: num_kv_heads is 0 (q of shape (1, 2, 0, 16), dense K segment 0 of 0 KV heads); attention needs num_kv_heads >= 1. Pass segments with at least one KV head and q/K/V with head_dim >= 1.""")  # noqa: B950

    def test_flash_attn_empty_contiguous_cache(self):
        q, kc = torch.randn(1, 1, 2, 8), torch.zeros(1, 0, 2, 8)
        msg = check_failing_call(self, lambda: kvops.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=0),
                                 ValueError, ["seqlen_cache = 0"])
        self.assertExpectedInline(msg, """flash_attn_with_kvcache: k_cache has seqlen_cache = 0 (shape (1, 0, 2, 8), read as [batch, seqlen_cache, num_kv_heads, head_dim]); it must be >= 1. Allocate the cache with at least one row (token) per sequence.""")  # noqa: B950

    def test_native_off_and_composite_in_one_subprocess(self):
        """The ZeroDivisionError cases with KVOPS_NATIVE=0, in every value-check mode: ValueError."""
        code = """
            import torch, kvops
            q, kc = torch.randn(1, 2, 8), torch.zeros(8, 0, 2, 8)
            args = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                    torch.zeros(1, 1, dtype=torch.int32), 1)
            for mode in ("eager", "off", "async"):
                with kvops.value_checks(mode):
                    for call in (lambda: kvops.paged_attention(q, kc, kc.clone(), *args),
                                 lambda: kvops.flash_attn_with_kvcache(q[None], torch.zeros(1, 0, 2, 8),
                                                                       torch.zeros(1, 0, 2, 8), cache_seqlens=0)):
                        try:
                            call()
                            print("NO ERROR")
                        except ValueError as e:
                            print("OK", str(e)[:40])
            """
        for env in ({"KVOPS_NATIVE": "0"},):  # (the native default mode: the generated batch; "off"/"async": above)
            with self.subTest(env=env):
                proc = run_isolated(code, env=env)
                self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
                want = ["OK " + m[:40] for m in ("kvops.paged_attention: k_cache has block_size = 0",
                                                  "flash_attn_with_kvcache: k_cache has seqlen_cache = 0")]
                self.assertEqual([x for x in proc.stdout.splitlines() if x.startswith(("OK", "NO"))], want * 3)


class TestValidateBeforeWrite(expecttest.TestCase):
    """§2: flash_attn_with_kvcache and streaming_update check everything before their first mutation."""

    def test_flash_attn_rejects_attention_args_before_appending(self):
        kc, vc = torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8)
        k, v = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
        table, lens = torch.tensor([[0, 1], [2, 3]], dtype=I32), torch.tensor([2, 3], dtype=I32)
        for what, q, kw, needles in (
            ("softcap", torch.randn(2, 1, 4, 8), dict(softcap=-1.0), ["softcap", "-1.0"]),
            ("window", torch.randn(2, 1, 4, 8), dict(window_size=(-5, -1)), ["window", "-5"]),
            ("head_dim", torch.randn(2, 1, 4, 16), {}, ["head_dim", "16"]),
            ("float64", torch.randn(2, 1, 4, 8).double(), {}, ["q", "float64"]),
            ("float16", torch.randn(2, 1, 4, 8).half(), {}, ["q dtype torch.float16"]),
        ):
            with self.subTest(what):
                check_failing_call(self, lambda: kvops.flash_attn_with_kvcache(
                    q, kc, vc, k, v, cache_seqlens=lens, block_table=table, **kw), ValueError, needles,
                    state=(kc, vc))
        msg = raises_everywhere(
            self, ValueError, lambda q, kc, vc, k, v: kvops.flash_attn_with_kvcache(
                q, kc, vc, k, v, cache_seqlens=lens, block_table=table, softcap=-1.0),
            (torch.randn(2, 1, 4, 8), kc, vc, k, v), compile_exc=torch._dynamo.exc.Unsupported)
        self.assertExpectedInline(msg, """kvops.paged_attention: softcap must be >= 0 (0 disables it), got -1.0.""")

    def test_streaming_update_checks_before_the_roll(self):
        kc, vc = torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)
        cursors, start = torch.tensor([8, 8]), torch.tensor(8)  # an evicting append: the roll would run first
        key = torch.randn(1, 2, 2, 8)
        for what, k, v, needles in (("float64", key, torch.randn(1, 2, 2, 8).double(), ["value", "float64"]),
                                    ("short value", key, torch.randn(1, 1, 2, 8), ["value", "(1, 1, 2, 8)"]),
                                    ("1-head key", key[:, :, :1], torch.randn(1, 2, 1, 8), ["1 heads"])):
            with self.subTest(what):
                msg = check_failing_call(self, lambda: kvops.export.streaming_update(k, v, kc, vc, cursors, start),
                                         ValueError, needles, state=(kc, vc, cursors, start))
        self.assertExpectedInline(msg, """kvops.export.streaming_update: key has 1 heads and value 1, but the caches hold 2 (k_cache shape (1, 8, 2, 8)); a streaming step writes all heads. Pass key/value with 2 heads (for a head slice use CausalKVCache with cache_head_start).""")  # noqa: B950
        msg = check_failing_call(self, lambda: kvops.export.streaming_update(
            key, key.clone(), kc, vc, cursors.to("meta"), start), ValueError, ["cursors", "meta"], state=(kc, vc))
        self.assertExpectedInline(msg, """kvops.export.streaming_update: cursors is on meta but the caches are on cpu; the step's positions are computed next to the caches. Pass cursors.to('cpu') (init_cursors(device) for a new stream).""")  # noqa: B950


class TestOverlappingCaches(expecttest.TestCase):
    """§4: caches sharing memory other than the joint K/V layouts are rejected, naming the two; joint ones work."""

    def test_overlap_is_rejected_naming_the_pair(self):
        buf = torch.zeros(4, 4, 2, 16)
        kc, vc = buf[..., :8], buf[..., 4:12]
        key, slots = torch.randn(3, 2, 8), torch.tensor([0, 5, 9])
        # eager only: torch.compile / torch.export trace storage identity neither (docs/semantics.md)
        msg = check_failing_call(self, lambda: kvops.paged_cache_write(key, key.clone(), kc, vc, slots), ValueError,
                                 ["k_cache and v_cache overlap"], state=buf)
        self.assertExpectedInline(msg, """kvops.paged_cache_write: k_cache and v_cache overlap in memory: k_cache shape (4, 4, 2, 8) strides (128, 32, 16, 1) offset 0, v_cache shape (4, 4, 2, 8) strides (128, 32, 16, 1) offset 4; a write to one would overwrite the other. Pass caches with disjoint memory (separate tensors, or the K and V halves of a joint allocation, e.g. kv[:, :, 0] and kv[:, :, 1] of [num_blocks, block_size, 2, num_kv_heads, head_dim]).""")  # noqa: B950
        self_overlap = torch.zeros(64).as_strided((1, 8, 2, 8), (32, 4, 2, 1))
        msg = check_failing_call(self, lambda: kvops.cache_write(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8),
                                                                 torch.zeros(1, 8, 2, 8), self_overlap, 0),
                                 ValueError, ["v_cache", "overlaps itself"], state=self_overlap)
        self.assertExpectedInline(msg, """kvops.cache_write: v_cache of shape (1, 8, 2, 8) and strides (32, 4, 2, 1) overlaps itself (two of its elements share memory), so what is written would not read back. Allocate the cache with its own storage (e.g. torch.zeros), or pass a view whose elements are distinct.""")  # noqa: B950

    def test_documented_and_disjoint_layouts_read_back(self):
        """Joint K/V layouts (NHD, HND, [P, 2, ...]) and a disjoint interleave: written values read back exactly."""
        key, value, slots = torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.tensor([0, 5, 9])
        layouts = {
            "[P, bs, 2, H, D]": lambda: (lambda kv: (kv[:, :, 0], kv[:, :, 1]))(torch.zeros(4, 4, 2, 2, 8)),
            "[P, 2, bs, H, D]": lambda: (lambda kv: (kv[:, 0], kv[:, 1]))(torch.zeros(4, 2, 4, 2, 8)),
            "interleaved dims": lambda: (lambda b: (b[..., 0::2], b[..., 1::2]))(torch.zeros(4, 4, 2, 16)),
        }
        for name, make in layouts.items():
            with self.subTest(name):
                kc, vc = make()
                kvops.paged_cache_write(key, value, kc, vc, slots)
                flat_k, flat_v = kc.reshape(16, 2, 8), vc.reshape(16, 2, 8)
                self.assertTrue(torch.equal(flat_k[slots], key) and torch.equal(flat_v[slots], value))
        kv = torch.zeros(4, 2, 2, 4, 8)  # HND joint
        kvops.paged_cache_write(key, value, kv[:, 0], kv[:, 1], slots, kv_layout="HND")
        self.assertTrue(torch.equal(kv[:, 0].transpose(1, 2).reshape(16, 2, 8)[slots], key))


class TestRotaryPositions(expecttest.TestCase):
    """§4: a position outside [0, seqlen_ro) never wraps around; the error names positions and the table length."""

    def setUp(self):
        self.kc, self.vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
        self.key, self.slots = torch.randn(3, 2, 8), torch.tensor([0, 5, 9])
        self.cos, self.sin = torch.randn(16, 4), torch.randn(16, 4)

    def write(self, positions):
        return lambda: kvops.rotary_paged_cache_write(self.key, self.key.clone(), self.kc, self.vc, self.slots,
                                                      positions, self.cos, self.sin)

    def test_negative_and_past_the_table(self):
        msg = check_failing_call(self, self.write(torch.tensor([0, -1, 2])), RuntimeError, ["positions[1] = -1"],
                                 state=(self.kc, self.vc))
        self.assertExpectedInline(msg, """kvops.rotary_paged_cache_write: positions[1] = -1 is outside [0, 16), the rows of rotary_cos/rotary_sin (seqlen_ro = 16); nothing was written. Pass positions in [0, seqlen_ro), or extend the tables.""")  # noqa: B950
        check_failing_call(self, self.write(torch.tensor([0, 16, 2])), RuntimeError, ["positions[1] = 16", "16)"],
                           state=(self.kc, self.vc))
        with kvops.value_checks("off"):  # the CPU kernel's own check
            msg = check_failing_call(self, self.write(torch.tensor([0, -1, 2])), IndexError, ["positions[1] = -1"],
                                     state=(self.kc, self.vc))
        with kvops.value_checks("async"):
            check_failing_call(self, self.write(torch.tensor([0, 99, 2])), RuntimeError, ["positions"],
                               state=(self.kc, self.vc))
        with self.assertRaisesRegex(RuntimeError, r"positions\[0\] = -2"):
            kvops.apply_rotary(self.key, self.cos, self.sin, torch.tensor([-2, 0, 0]))

    def test_flash_attn_negative_cache_seqlens(self):
        q, k = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8)
        kc, vc = torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8)
        check_failing_call(self, lambda: kvops.flash_attn_with_kvcache(
            q, kc, vc, k, k.clone(), torch.randn(8, 4), torch.randn(8, 4), cache_seqlens=torch.tensor([-1], dtype=I32)),
            RuntimeError, ["cache_seqlens=-1"], state=(kc, vc))


class TestPacked(expecttest.TestCase):
    def test_non_finite_inputs_stay_visible_without_spreading(self):
        """Before: inf saturated, NaN was stored as 0, silently): a NaN or +-inf input dequantizes to NaN
        -- the value itself (fp8: a NaN code), its (token, head) row (int8: a NaN scale) or its group (int4, int2: a
        NaN scale) -- as attention over a dense cache holding it gives NaN; every other value is as without it. CPU
        kernels and the Triton kernels (interpreter)."""
        from kvops.cpu import packed as reference
        from kvops.triton import packed_quant as triton_quant

        x = torch.randn(1, 16, 2, 32)
        bad = x.clone()
        bad[0, 3, 0, 5], bad[0, 7, 1, 9], bad[0, 9, 0, 1] = float("inf"), float("nan"), -float("inf")
        finite = torch.ones_like(x, dtype=torch.bool)
        finite[0, 3, 0, 5] = finite[0, 7, 1, 9] = finite[0, 9, 0, 1] = False
        zeroed = torch.where(finite, bad, 0.0)
        spans = {"fp8": 1, "int8": 32, "int4": 32, "int2": 32}  # default group_size at D = 32: the whole row
        for quant in kp.FORMATS:
            for name, quantize, dequantize in (("cpu", reference.quantize, reference.dequantize),
                                               ("triton", triton_quant.quantize, triton_quant.dequantize)):
                with self.subTest(quant, kernel=name):
                    p, clean = kp.quantize_kv(zeroed, quant), kp.quantize_kv(zeroed, quant)
                    quantize(bad, *p[1:], quant, 4)
                    got = dequantize(*p[1:], quant, torch.float32)
                    want = kp.dequantize_kv(clean, torch.float32)
                    span = spans[quant]
                    hit = torch.zeros_like(finite)
                    for t, h, e in ((3, 0, 5), (7, 1, 9), (9, 0, 1)):
                        hit[0, t, h, e // span * span:(e // span + 1) * span] = True
                    self.assertTrue(got[hit].isnan().all(), got[hit])  # visible: NaN where a non-finite value was
                    self.assertTrue(torch.equal(got[~hit], want[~hit]))  # nothing spreads
        wide = torch.cat([bad, x], dim=-1)  # D = 64, groups of 32: only the non-finite value's group is NaN
        g32 = kp.dequantize_kv(kp.quantize_kv(wide, "int4", group_size=32), torch.float32)
        self.assertTrue(g32[0, 3, 0, :32].isnan().all() and torch.isfinite(g32[0, 3, 0, 32:]).all())

    def test_fp8_zero_tokens(self):
        p = kp.quantize_kv(torch.randn(1, 0, 2, 16), "fp8")
        self.assertEqual(tuple(kp.dequantize_kv(p, torch.float32).shape), (1, 0, 2, 16))

    def test_int2_cluster_ids_out_of_range(self):
        p = kp.quantize_kv(torch.randn(1, 16, 2, 16), "int2")
        ids = p.cluster_ids.clone()
        ids[0, 3, 1] = 200
        msg = check_failing_call(self, lambda: kp.dequantize_kv(p._replace(cluster_ids=ids)), RuntimeError,
                                 ["cluster_ids[0, 3, 1] = 200"])
        self.assertExpectedInline(msg, """kvops.dequantize_kv: cluster_ids[0, 3, 1] = 200 is not a centroid of its segment: cluster ids must be in [0, 16) (centroids [B, H, 16, D]). Pass the cluster_ids that kvops.packed.quantize_kv wrote with those centroids.""")  # noqa: B950
        import kvops.cpu.packed as ref
        from kvops._checks.packed import split_segments  # noqa: F401  (the composite's layout)

        q = torch.randn(1, 2, 4, 16)
        bad = p._replace(cluster_ids=ids)
        with self.assertRaisesRegex(RuntimeError, r"kvops.packed_attention: cluster_ids\[0, 3, 1\] = 200"):
            ref.packed_attention(q, [], [], bad.tensors(), p.tensors(), "int2", 0.25)

    def test_packed_attention_backward_raises(self):
        q = torch.randn(1, 2, 4, 16, requires_grad=True)
        out = kp.packed_attention(q, [torch.randn(1, 4, 2, 16)], [torch.randn(1, 4, 2, 16)])
        self.assertTrue(out.requires_grad)
        with self.assertRaisesRegex(RuntimeError, "no autograd formula"):
            out.sum().backward()


class TestMessages(expecttest.TestCase):
    def test_hnd_cache_layout_first(self):
        q, kc = torch.randn(3, 6, 8), torch.zeros(6, 2, 4, 8)
        cu, lens, table = torch.tensor([0, 3], dtype=I32), torch.tensor([3], dtype=I32), torch.zeros(1, 1, dtype=I32)
        msg = check_failing_call(self, lambda: kvops.paged_attention(q, kc, kc.clone(), cu, lens, table, 3),
                                 ValueError, ["HND"])
        self.assertTrue(msg.startswith("kvops.paged_attention: The cache of shape"))
        self.assertExpectedInline(msg, """kvops.paged_attention: The cache of shape (6, 2, 4, 8) read as kv_layout="NHD" has 4 heads, but its dim of size 2 fits the 6 query heads: it may be an HND cache [num_blocks, num_kv_heads, block_size, head_dim]; if so, pass kv_layout="HND". (Read as NHD, num_heads (6) must be a multiple of num_kv_heads (4) (GQA: query head h reads KV head h // (num_heads // num_kv_heads)).)""")  # noqa: B950


if __name__ == "__main__":
    unittest.main()

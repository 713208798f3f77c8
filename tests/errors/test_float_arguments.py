"""The ops' float arguments (softmax scales, softcaps, RoPE's theta and scale; docs/compile.md "Float arguments") in
the forms other than a Python float.

NumPy scalars (docs/porting.md "FlashAttention's argument forms"): eager calls and ``torch.export`` read them as
Python floats, with the Python float's results and errors. ``torch.compile(fullgraph=True)`` reads a finite float64 or
int64 one as it reads a Python number (same results); one whose value it does not read while tracing (``np.float32``,
``np.float16``, a NaN or infinite float64: a 0-d array to Dynamo, ``float()`` of it an unbacked SymFloat, which no
op's ``float`` argument takes) is a ``ValueError`` naming the argument and the form that compiles, raised while
tracing, before anything runs (it was "sympy expression is NaN" or a failed guard).

A 0-d tensor (``kvops.paged_attention``'s ``scale``): read in eager calls; compiled or exported, the ``ValueError``
of a tensor where a Python value is needed (it was the dispatcher's schema error)."""

import ast
import re

import expecttest
import numpy as np
import torch

import kvops
from kvops.integrations.flashinfer import BatchDecodeWithPagedKVCacheWrapper
from kvops.packed import packed_attention
from tests.contract import _Wrap, raises_everywhere

I32 = torch.int32
READ = (np.float32, np.float16, np.float64, np.int64)  # eager and torch.export
COMPILED = (np.float64, np.int64)  # torch.compile reads their values


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, kc, vc = (torch.randn(3, 4, 8, generator=g), torch.randn(3, 4, 2, 8, generator=g),
                 torch.randn(3, 4, 2, 8, generator=g))
    cu, lens = torch.tensor([0, 2, 3], dtype=I32), torch.tensor([6, 7], dtype=I32)
    table = torch.tensor([[0, 1], [0, 2]], dtype=I32)
    return q, kc, vc, cu, lens, table


def paged(name, **fixed):
    q, kc, vc, cu, lens, table = _inputs()
    return (lambda q, kc, vc, x: kvops.paged_attention(q, kc, vc, cu, lens, table, 2, **fixed, **{name: x})), \
        (q, kc, vc)


def flash(name):
    g = torch.Generator().manual_seed(1)
    q, kc, vc = torch.randn(2, 1, 4, 8, generator=g), torch.randn(2, 6, 2, 8, generator=g), \
        torch.randn(2, 6, 2, 8, generator=g)
    lens = torch.tensor([5, 3], dtype=I32)
    return (lambda q, kc, vc, x: kvops.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, **{name: x})), \
        (q, kc, vc)


def mla():
    g = torch.Generator().manual_seed(2)
    q, cache = torch.randn(3, 4, 12, generator=g), torch.randn(3, 4, 12, generator=g)
    _, _, _, cu, lens, table = _inputs()
    return (lambda q, cache, x: kvops.mla_attention(q, cache, cu, lens, table, 2, 8, scale=x)[0]), (q, cache)


def packed():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 5, 2, 8, generator=g), \
        torch.randn(1, 5, 2, 8, generator=g)
    return (lambda q, k, v, x: packed_attention(q, [k], [v], scale=x)), (q, k, v)


def cascade(name):
    q, kc, vc, cu, lens, table = _inputs()
    plan = kvops.plan_cascade(table, lens, cu, 4)
    return (lambda q, kc, vc, x: kvops.cascade_attention(q, kc, vc, cu, lens, table, 2, plan, **{name: x})), \
        (q, kc, vc)


# (argument, fn(*args, value), args, a value every dtype of READ holds exactly: an integer)
CASES = {
    "paged_attention": [("scale", *paged("scale"), 2.0), ("softcap", *paged("softcap"), 3.0),
                        ("rope_theta", *paged("rope_theta"), 256.0),
                        ("rope_scale", *paged("rope_scale", rope_theta=1e4), 2.0)],
    "flash_attn_with_kvcache": [("softmax_scale", *flash("softmax_scale"), 2.0), ("softcap", *flash("softcap"), 2.0)],
    "mla_attention": [("scale", *mla(), 2.0)],
    "packed_attention": [("scale", *packed(), 2.0)],
    "cascade_attention": [("scale", *cascade("scale"), 2.0), ("softcap", *cascade("softcap"), 2.0)],
}


def compiled_message(test, fn, args) -> str:
    """The ``ValueError`` message a ``torch.compile(fullgraph=True)`` call raised while tracing (Dynamo's
    ``Unsupported`` carries it: either form of tests.contract.dynamo_exception_forms)."""
    torch._dynamo.reset()
    with test.assertRaises(torch._dynamo.exc.Unsupported) as cm:
        torch.compile(fn, fullgraph=True, backend="eager")(*args)
    found = re.search(r"""ValueError\((?:\[ConstantVariable\(str: )?((['"])(?:\\.|(?!\2).)*\2)""", str(cm.exception))
    test.assertIsNotNone(found, str(cm.exception))
    return ast.literal_eval(found.group(1))


class TestNumpyScalars(expecttest.TestCase):
    def check_op(self, op) -> str:
        """Every argument of ``op`` with every NumPy scalar of READ: eager and torch.export results equal the Python
        float's; compiled, those of COMPILED too, and the others' messages (returned, one line per argument)."""
        messages = []
        for name, fn, args, value in CASES[op]:
            expected = fn(*args, value)
            for dtype in READ:
                x = dtype(value)
                torch.testing.assert_close(fn(*args, x), expected, atol=0, rtol=0, msg=f"{name}={x!r}")
                exported = torch.export.export(_Wrap(lambda *a, x=x: fn(*a, x)), args, strict=False).module()
                torch.testing.assert_close(exported(*args), expected, atol=0, rtol=0, msg=f"export {name}={x!r}")
            for dtype in COMPILED:
                torch._dynamo.reset()
                out = torch.compile(fn, fullgraph=True, backend="eager")(*args, dtype(value))
                torch.testing.assert_close(out, expected, atol=0, rtol=0, msg=f"compiled {name}={dtype(value)!r}")
            x = np.float32(value)  # made outside the compiled function (made inside, Dynamo folds it to a constant)
            message = compiled_message(self, lambda *a: fn(*a, x), args)
            self.assertEqual(compiled_message(self, fn, (*args, np.float16(value))), message)  # as an argument too
            messages.append(message)
        return "\n".join(messages)

    def test_paged_attention(self):
        self.assertExpectedInline(self.check_op("paged_attention"), """\
kvops.paged_attention: scale was given as a NumPy scalar whose value torch.compile does not read while tracing (a dtype other than float64 and int64, such as np.float32, or a NaN or infinite value), and scale is needed as a Python float when the call is traced. Pass scale=float(scale) outside the compiled function (NumPy scalars of any dtype are read in eager calls and by torch.export).
kvops.paged_attention: softcap was given as a NumPy scalar whose value torch.compile does not read while tracing (a dtype other than float64 and int64, such as np.float32, or a NaN or infinite value), and softcap is needed as a Python float when the call is traced. Pass softcap=float(softcap) outside the compiled function (NumPy scalars of any dtype are read in eager calls and by torch.export).
kvops.paged_attention: rope_theta was given as a NumPy scalar whose value torch.compile does not read while tracing (a dtype other than float64 and int64, such as np.float32, or a NaN or infinite value), and rope_theta is needed as a Python float when the call is traced. Pass rope_theta=float(rope_theta) outside the compiled function (NumPy scalars of any dtype are read in eager calls and by torch.export).
kvops.paged_attention: rope_scale was given as a NumPy scalar whose value torch.compile does not read while tracing (a dtype other than float64 and int64, such as np.float32, or a NaN or infinite value), and rope_scale is needed as a Python float when the call is traced. Pass rope_scale=float(rope_scale) outside the compiled function (NumPy scalars of any dtype are read in eager calls and by torch.export).""")

    def test_flash_attn_with_kvcache(self):
        self.assertExpectedInline(self.check_op("flash_attn_with_kvcache"), """\
flash_attn_with_kvcache: softmax_scale was given as a NumPy scalar whose value torch.compile does not read while tracing (a dtype other than float64 and int64, such as np.float32, or a NaN or infinite value), and softmax_scale is needed as a Python float when the call is traced. Pass softmax_scale=float(softmax_scale) outside the compiled function (NumPy scalars of any dtype are read in eager calls and by torch.export).
flash_attn_with_kvcache: softcap was given as a NumPy scalar whose value torch.compile does not read while tracing (a dtype other than float64 and int64, such as np.float32, or a NaN or infinite value), and softcap is needed as a Python float when the call is traced. Pass softcap=float(softcap) outside the compiled function (NumPy scalars of any dtype are read in eager calls and by torch.export).""")

    def test_mla_attention(self):
        self.assertExpectedInline(self.check_op("mla_attention"), """kvops.mla_attention: scale was given as a NumPy scalar whose value torch.compile does not read while tracing (a dtype other than float64 and int64, such as np.float32, or a NaN or infinite value), and scale is needed as a Python float when the call is traced. Pass scale=float(scale) outside the compiled function (NumPy scalars of any dtype are read in eager calls and by torch.export).""")

    def test_packed_attention(self):
        self.assertExpectedInline(self.check_op("packed_attention"), """kvops.packed_attention: scale was given as a NumPy scalar whose value torch.compile does not read while tracing (a dtype other than float64 and int64, such as np.float32, or a NaN or infinite value), and scale is needed as a Python float when the call is traced. Pass scale=float(scale) outside the compiled function (NumPy scalars of any dtype are read in eager calls and by torch.export).""")

    def test_cascade_attention(self):
        self.assertExpectedInline(self.check_op("cascade_attention"), """\
kvops.cascade_attention: scale was given as a NumPy scalar whose value torch.compile does not read while tracing (a dtype other than float64 and int64, such as np.float32, or a NaN or infinite value), and scale is needed as a Python float when the call is traced. Pass scale=float(scale) outside the compiled function (NumPy scalars of any dtype are read in eager calls and by torch.export).
kvops.cascade_attention: softcap was given as a NumPy scalar whose value torch.compile does not read while tracing (a dtype other than float64 and int64, such as np.float32, or a NaN or infinite value), and softcap is needed as a Python float when the call is traced. Pass softcap=float(softcap) outside the compiled function (NumPy scalars of any dtype are read in eager calls and by torch.export).""")

    def test_compile_without_fullgraph_runs_eagerly(self):
        """Without ``fullgraph=True`` the refusal is a graph break: the call runs eagerly, with the eager result."""
        _, fn, args, value = CASES["paged_attention"][0]
        torch._dynamo.reset()
        out = torch.compile(fn, backend="eager")(*args, np.float32(value))
        torch.testing.assert_close(out, fn(*args, value), atol=0, rtol=0)

    def test_flash_attn_writes_nothing(self):
        """The compiled refusal comes while tracing: the new keys are not written."""
        q, kc, vc = torch.randn(1, 1, 2, 8), torch.zeros(1, 6, 2, 8), torch.zeros(1, 6, 2, 8)
        k = torch.randn(1, 1, 2, 8)
        compiled_message(self, lambda q, kc, vc, c: kvops.flash_attn_with_kvcache(
            q, kc, vc, k, k, cache_seqlens=torch.tensor([2], dtype=I32), softcap=c), (q, kc, vc, np.float32(1.0)))
        self.assertTrue(bool((kc == 0).all()) and bool((vc == 0).all()))


class TestTensorScale(expecttest.TestCase):
    def test_paged_attention(self):
        fn, args = paged("scale")
        torch.testing.assert_close(fn(*args, torch.tensor(0.5)), fn(*args, 0.5), atol=0, rtol=0)
        msg = raises_everywhere(self, ValueError, fn, (*args, torch.tensor(0.5)), modes=("export", "compile"),
                                compile_exc=torch._dynamo.exc.Unsupported)
        self.assertExpectedInline(msg, """kvops.paged_attention: scale was given as a tensor while compiling or exporting; its value is needed as a Python float when the call is traced, and reading a tensor there would bake one value into the graph. Pass scale as a float (e.g. scale=float(scale) outside the compiled function); a tensor scale is read once in eager calls only.""")


class TestNonFiniteNumpyScalars(expecttest.TestCase):
    """A NaN or infinite NumPy scalar is refused as the Python float is: the same ``ValueError`` and message in eager
    calls and torch.export (compiled: the Python float's in all three modes); ``torch.compile`` does not read the value
    of a NaN or infinite NumPy scalar while tracing, of any dtype, so it gets the NumPy message."""

    def check(self, fn, args, python_value, compile_exc=torch._dynamo.exc.TorchRuntimeError) -> tuple[str, str]:
        message = raises_everywhere(self, ValueError, lambda *a: fn(*a, python_value), args, compile_exc=compile_exc)
        compiled = set()
        for x in (np.float32(python_value), np.float64(python_value), np.float16(python_value)):
            self.assertEqual(raises_everywhere(self, ValueError, lambda *a, x=x: fn(*a, x), args,
                                               modes=("eager", "export")), message)
            compiled.add(compiled_message(self, fn, (*args, x)))
        self.assertEqual(len(compiled), 1, compiled)
        return message, compiled.pop()

    def test_paged_attention_softcap_nan(self):
        fn, args = paged("softcap")
        self.assertExpectedInline("\n".join(self.check(fn, args, float("nan"))), """\
kvops.paged_attention: softcap must be a finite number (scores become softcap * tanh(score / softcap); 0 disables it), got nan. Pass a finite softcap >= 0 (e.g. Gemma-2's 50.0), or 0.0 for none.
kvops.paged_attention: softcap was given as a NumPy scalar whose value torch.compile does not read while tracing (a dtype other than float64 and int64, such as np.float32, or a NaN or infinite value), and softcap is needed as a Python float when the call is traced. Pass softcap=float(softcap) outside the compiled function (NumPy scalars of any dtype are read in eager calls and by torch.export).""")

    def test_paged_attention_scale_inf(self):
        fn, args = paged("scale")
        self.assertExpectedInline(self.check(fn, args, float("inf"))[0], """kvops.paged_attention: scale must be a finite number (the softmax scale on q·k; None: head_dim ** -0.5), got inf. Pass a finite scale, or None for the default.""")  # noqa: B950

    def test_flash_attn_softmax_scale_neg_inf(self):
        fn, args = flash("softmax_scale")
        self.assertExpectedInline("\n".join(self.check(fn, args, -float("inf"), torch._dynamo.exc.Unsupported)), """\
kvops.paged_attention: scale must be a finite number (the softmax scale on q·k; None: head_dim ** -0.5), got -inf. Pass a finite scale, or None for the default.
flash_attn_with_kvcache: softmax_scale was given as a NumPy scalar whose value torch.compile does not read while tracing (a dtype other than float64 and int64, such as np.float32, or a NaN or infinite value), and softmax_scale is needed as a Python float when the call is traced. Pass softmax_scale=float(softmax_scale) outside the compiled function (NumPy scalars of any dtype are read in eager calls and by torch.export).""")  # noqa: B950

    def test_mla_attention_scale_nan(self):
        fn, args = mla()
        self.assertExpectedInline(self.check(fn, args, float("nan"))[0], """kvops.mla_attention: scale must be a finite number (the softmax scale on the scores q . row; None: (kv_lora_rank + rope_dim) ** -0.5), got nan. Pass a finite scale (DeepSeek: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5).""")


class TestFlashInferWrapper(expecttest.TestCase):
    """FlashInfer's decode wrapper (host-side ``plan``, eager ``run``): NumPy scalars as its float arguments are read
    as Python floats, a NaN one refused by ``plan``/``run`` with the Python float's message (it was taken, and ``plan``
    let a NaN ``np.float32`` through to ``run``)."""

    def setUp(self):
        g = torch.Generator().manual_seed(4)
        self.q, self.kc, self.vc = torch.randn(1, 4, 16, generator=g), torch.randn(2, 4, 2, 16, generator=g), \
            torch.randn(2, 4, 2, 16, generator=g)
        self.indptr, self.indices = torch.tensor([0, 2], dtype=I32), torch.tensor([0, 1], dtype=I32)
        self.last = torch.tensor([3], dtype=I32)

    def run_with(self, plan_kwargs, run_kwargs=None):
        wrapper = BatchDecodeWithPagedKVCacheWrapper()
        wrapper.plan(self.indptr, self.indices, self.last, 4, 2, 16, 4, q_data_type=torch.float32, **plan_kwargs)
        return wrapper.run(self.q, (self.kc, self.vc), **(run_kwargs or {}))

    def test_numpy_scalars(self):
        plan = dict(sm_scale=0.25, logits_soft_cap=3.0, pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0,
                    rope_theta=256.0)
        run = dict(q_scale=2.0, k_scale=0.5, v_scale=4.0)
        expected = self.run_with(plan, run)
        for dtype in READ[:3]:  # (0.25 and 0.5 are not integers)
            got = self.run_with({k: dtype(x) if isinstance(x, float) else x for k, x in plan.items()},
                                {k: dtype(x) for k, x in run.items()})
            torch.testing.assert_close(got, expected, atol=0, rtol=0, msg=str(dtype))

    def test_nan(self):
        messages = []
        for where, name in (("plan", "sm_scale"), ("plan", "logits_soft_cap"), ("run", "q_scale")):
            found = set()
            for x in (float("nan"), np.float32("nan"), np.float16("nan")):
                with self.assertRaises(ValueError) as cm:
                    self.run_with({name: x} if where == "plan" else {}, {name: x} if where == "run" else {})
                found.add(str(cm.exception))
            self.assertEqual(len(found), 1, found)
            messages += found
        self.assertExpectedInline("\n".join(messages), """\
BatchDecodeWithPagedKVCacheWrapper.plan: sm_scale must be a finite number (None: head_dim ** -0.5), got nan. Pass a finite sm_scale.
BatchDecodeWithPagedKVCacheWrapper.plan: logits_soft_cap must be a finite number (None or >= 0; 0/None: off), got nan. Pass a finite logits_soft_cap.
BatchDecodeWithPagedKVCacheWrapper.run: q_scale must be a finite number (a calibration scale; None: 1), got nan. Pass a finite q_scale, or None.""")


if __name__ == "__main__":
    import unittest

    unittest.main()

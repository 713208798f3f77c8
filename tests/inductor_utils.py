"""Helpers shared by the Inductor lowering tests: compile and read the generated code, RoPE producer, fresh cache."""

import re

import expecttest
import torch
import torch._dynamo
from torch._inductor.utils import fresh_inductor_cache, run_and_get_code


def compiled(fn, *args):
    """Run ``torch.compile(fn, fullgraph=True)(*args)`` from a clean Dynamo state; returns (result, generated code)."""
    torch._dynamo.reset()
    out, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return out, "\n".join(codes)


def code_facts(code: str) -> str:
    """The stable facts of generated code: how many C++ kernels, how many extern calls into kvops."""
    kernels = re.findall(r"^\w+ = async_compile\.cpp_pybinding", code, re.M)
    kvops_calls = re.findall(r"(?<!')torch\.ops\.kvops\.\w+\.default\(", code)
    return f"cpp kernels: {len(kernels)}, kvops calls: {len(kvops_calls)}"


def rope(x, cos, sin_signed):
    """Rotate-half RoPE in fp32, cast back to x's dtype (``roll`` instead of ``cat``: Inductor's CPU ``cat`` is a
    separate kernel). ``sin_signed`` is ``sin`` with the first half negated, so ``roll(x) * sin_signed`` equals
    ``cat(-x2, x1) * sin`` exactly."""
    xf = x.float()
    return (xf * cos + torch.roll(xf, x.shape[-1] // 2, dims=-1) * sin_signed).to(x.dtype)


def rope_tables(t, d):
    pos = torch.arange(t, dtype=torch.float32)[:, None] / (10000 ** (torch.arange(0, d, 2) / d))
    cos, sin = torch.cat((pos.cos(), pos.cos()), -1), torch.cat((-pos.sin(), pos.sin()), -1)
    return cos[:, None, :], sin[:, None, :]  # [T, 1, D]


class FreshInductorCache(expecttest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls._cache = fresh_inductor_cache()
        cls._cache.__enter__()

    @classmethod
    def tearDownClass(cls):
        cls._cache.__exit__(None, None, None)

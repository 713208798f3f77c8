"""Test-session setup.

Without a GPU, Triton kernels run in the Triton interpreter on CPU tensors: ``TRITON_INTERPRET=1`` must be set before
``triton.jit`` decorates the kernels, i.e. before ``import kvops``. Tests call the Triton launchers in ``kvops.triton``
directly on CPU tensors; the ops themselves dispatch CPU tensors to the CPU kernels.
"""

import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The 14 "`torch.jit.script_method` is deprecated" DeprecationWarnings come from torch itself, not kvops: the first
# torch.compile with Inductor imports torch._inductor.fx_passes.pre_grad -> torch.fx.experimental.optimization ->
# torch.utils.mkldnn, whose module-level ScriptModules (MkldnnLinear, MkldnnConv*, MkldnnBatchNorm, MkldnnPrelu)
# apply the deprecated @torch.jit.script_method 14 times (torch 2.13). Import that module once here with exactly this
# warning silenced; any other warning, and this one from any other code, is still reported.
# Under pytest-xdist (the README's `-n 2`), each worker takes its share of the cores for torch's intra-op threads, so
# two workers on 2 cores do not run 4 spinning OpenMP threads. Tests that set their own thread count still do.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated", category=DeprecationWarning)
    import torch.utils.mkldnn  # noqa: F401


# `python -m pytest -q -m quick tests`: a first check of the core (the contiguous and paged ops in eager, compile and
# export, the cache classes, the README's code), a few minutes on 2 idle cores, a fraction of the whole suite; CI runs the
# whole suite. The marker is given here per module (pyproject.toml declares it), so test files stay unchanged.
QUICK_MODULES = {
    "test_contiguous_ops",
    "test_paged_write",
    "test_paged_attention",
    "test_causal_cache",
    "test_paged_cache",
    "test_readme",
}


# `-m aot`: the ahead-of-time Triton compile check, which CI also runs with torch 2.11's Triton 3.6 (.ci/run).
AOT_MODULES = {"test_gpu_aot"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        if module in QUICK_MODULES:
            item.add_marker(pytest.mark.quick)
        if module in AOT_MODULES:
            item.add_marker(pytest.mark.aot)


def _plain(value):
    return value if value is None or isinstance(value, (str, int, float, bool)) else repr(value)


@pytest.hookimpl(wrapper=True)
def pytest_report_to_serializable(config, report):
    """pytest-xdist sends each report from its worker as plain data: a unittest ``subTest(dtype=torch.bfloat16)``
    would fail to serialize (``DumpError: can't serialize <class 'torch.dtype'>``) and fail the test. Its
    parameters travel as their repr, which is also how the report prints them."""
    data = yield
    context = data.get("_subtest.context") if isinstance(data, dict) else None
    if context and context.get("kwargs"):
        context["kwargs"] = {k: _plain(v) for k, v in context["kwargs"].items()}
    return data

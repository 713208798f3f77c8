"""Test-session setup.

Without a GPU, Triton kernels run in the Triton interpreter on CPU tensors: ``TRITON_INTERPRET=1`` must be set before
``triton.jit`` decorates the kernels, i.e. before ``import kvops``. Tests call the Triton launchers in ``kvops.triton``
directly on CPU tensors; the ops themselves dispatch CPU tensors to the CPU kernels.
"""

import os
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The 14 "`torch.jit.script_method` is deprecated" DeprecationWarnings come from torch itself, not kvops: the first
# torch.compile with Inductor imports torch._inductor.fx_passes.pre_grad -> torch.fx.experimental.optimization ->
# torch.utils.mkldnn, whose module-level ScriptModules (MkldnnLinear, MkldnnConv*, MkldnnBatchNorm, MkldnnPrelu)
# apply the deprecated @torch.jit.script_method 14 times (torch 2.13). Import that module once here with exactly this
# warning silenced; any other warning, and this one from any other code, is still reported.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated", category=DeprecationWarning)
    import torch.utils.mkldnn  # noqa: F401


# `python -m pytest -q -m quick tests`: a first check of the core (the contiguous and paged ops in eager, compile and
# export, the cache classes, the README's code), a few minutes on 2 idle cores against the suite's ~8; CI runs the
# whole suite. The marker is given here per module (pyproject.toml declares it), so test files stay unchanged.
QUICK_MODULES = {
    "test_contiguous_ops",
    "test_paged_write",
    "test_paged_attention",
    "test_causal_cache",
    "test_paged_cache",
    "test_readme",
}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in QUICK_MODULES:
            item.add_marker(pytest.mark.quick)

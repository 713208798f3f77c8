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

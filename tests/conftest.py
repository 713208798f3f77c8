"""Test-session setup.

Without a GPU, Triton kernels run in the Triton interpreter on CPU tensors: ``TRITON_INTERPRET=1`` must be set before
``triton.jit`` decorates the kernels, i.e. before ``import kvops``. Tests call the Triton launchers in ``kvops.triton``
directly on CPU tensors; the ops themselves dispatch CPU tensors to the CPU kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

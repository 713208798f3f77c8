"""Triton kernels and their launchers (CUDA; tested on CPU tensors with ``TRITON_INTERPRET=1``).

``HAS_TRITON`` is False where triton is not installed; the CUDA registrations are skipped then.
"""

import contextlib
import logging

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - platforms without triton
    HAS_TRITON = False


# Records torch logs at WARNING when triton is missing while kvops registers itself, though there is nothing wrong:
# without triton kvops registers no CUDA kernels. (logger, message prefix), each checked on torch 2.13 and 2.14.
_NO_TRITON_RECORDS = (
    ("torch._library.triton", "Triton not available"),  # torch.library.triton_op inspecting kvops::paged_attention
    ("torch.utils.flop_counter", "triton not found"),  # torch 2.14: importing torch._functorch (kvops' lowerings)
)


@contextlib.contextmanager
def quiet_without_triton():
    """Where triton is not installed, drop exactly the records of ``_NO_TRITON_RECORDS`` while kvops registers its ops
    and lowerings (a plain ``import torch`` prints none of them: they would be the first lines a user without Triton
    sees after ``import kvops``). Every other record goes through; with triton installed this does nothing."""
    if HAS_TRITON:
        yield
        return
    filters = []
    for name, prefix in _NO_TRITON_RECORDS:
        drop = lambda record, prefix=prefix: not record.getMessage().startswith(prefix)  # noqa: E731
        logging.getLogger(name).addFilter(drop)
        filters.append((name, drop))
    try:
        yield
    finally:
        for name, drop in filters:
            logging.getLogger(name).removeFilter(drop)

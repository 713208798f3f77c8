"""The argument forms the peers accept for scalar arguments, resolved to the Python values kvops' ops take.

FlashAttention's ``flash_attn_with_kvcache`` hands ``window_size[0]``, ``window_size[1]``, ``softmax_scale``,
``softcap``, ``causal``, ``rotary_interleaved`` and ``num_splits`` to a pybind11 C++ function, which converts them:
an ``int`` parameter takes a Python int (``bool`` included) or any object with ``__index__`` (NumPy integers,
one-element integer tensors such as ``torch.randint(0, n, (2,))[0]``) and never a float; a ``float`` parameter takes
ints, floats and objects with ``__float__`` (one-element tensors); a ``bool`` parameter takes anything with a truth
value. ``window_size`` itself is indexed, so a tuple, a list or a 2-element tensor all work (FlashAttention's own
``test_flash_attn_kvcache`` passes ``window_size = torch.randint(0, seqlen_k, (2,))``). kvops accepts the same
forms, with the same meaning, and refuses the rest with a ``ValueError`` naming the argument (docs/porting.md,
"FlashAttention's argument forms").

A tensor where the kernel needs a Python value is read once in eager calls (a tensor on the CPU, as in
FlashAttention's test, costs no device sync). While ``torch.compile``/``torch.export`` trace the call its value is
not known: reading it would bake one value into the graph or need a data-dependent guard, so it is refused with an
error naming the form that compiles (a Python int/float/bool). Without ``fullgraph=True``, ``torch.compile`` then
falls back to running the call eagerly, where the tensor is read as above.
"""

from __future__ import annotations

import operator

import numpy as np
import torch

from .common import has_value

_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)


def tracing(x: torch.Tensor) -> bool:
    """Whether ``x``'s value cannot be read now: a traced call (Dynamo, ``torch.export``) or a fake/meta tensor."""
    return torch.compiler.is_compiling() or type(x) not in (torch.Tensor, torch.nn.Parameter) or x.is_meta


def _refuse_traced(op: str, name: str, form: str, fix: str) -> None:
    raise ValueError(
        f"{op}: {name} was given as a tensor while compiling or exporting; its value is needed as a Python {form} "
        f"when the call is traced, and reading a tensor there would bake one value into the graph. Pass {name} as a "
        f"{form} (e.g. {fix} outside the compiled function); a tensor {name} is read once in eager calls only."
    )


def _integral_tensor(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def int_arg(op: str, name: str, x, *, wanted: str = "an int"):
    """``x`` as FlashAttention's pybind11 ``int`` parameters take it: an int (``bool`` included), an object with
    ``__index__`` (NumPy integers), a one-element integer tensor (read in eager calls); a SymInt passes through."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or not _integral_tensor(x):
            raise ValueError(
                f"{op}: {name} must be {wanted}; a tensor {name} must hold one integer element, got a tensor of shape "
                f"{tuple(x.shape)} and dtype {x.dtype}."
            )
        if tracing(x):
            _refuse_traced(op, name, "int", f"{name}=int({name})")
        return int(x)
    if isinstance(x, torch.SymInt):
        return x
    try:
        return operator.index(x)
    except TypeError:
        raise ValueError(
            f"{op}: {name} must be {wanted}, got {type(x).__name__} {x!r}. Pass a whole number (int({name}) if it is "
            f"integral)."
        ) from None


def python_float(op: str, name: str, x):
    """``x`` of an op's float argument (a softmax scale, a softcap, ...) as the op takes it: a NumPy integer or
    floating scalar as ``float(x)`` (``np.float64`` is a float already), anything else unchanged (the op's checks take
    it). Public wrappers call it before their own arithmetic on the value and before dispatch; eager calls and
    ``torch.export`` read a NumPy scalar here.

    While a call is traced the value must be a Python number: ``torch.compile`` traces a NumPy scalar as a 0-d array,
    and reads the value of a finite float64 or int64 one (the dtypes of Python's numbers) as of a Python number, but not
    of any other (``np.float32``, ``np.float16``, ``np.int32``; a NaN or infinite float64): ``float(x)`` is then a
    number without a value (an unbacked SymFloat), which an op's ``float`` argument cannot take (torch's
    ``scaled_dot_product_attention(scale=np.float32(0.1))`` fails alike); a tensor has no value either (one is read in
    eager calls). Both are a ``ValueError`` naming the argument and the form that compiles (docs/compile.md "Float
    arguments")."""
    if isinstance(x, (np.floating, np.integer)):
        return float(x)
    if isinstance(x, torch.Tensor) and tracing(x):
        _refuse_traced(op, name, "float", f"{name}=float({name})")
    if isinstance(x, np.ndarray) and torch.compiler.is_compiling() and x.ndim == 0:  # Dynamo's NumPy scalar
        value = float(x)
        if not has_value(value):
            raise ValueError(
                f"{op}: {name} was given as a NumPy scalar whose value torch.compile does not read while tracing (a "
                f"dtype other than float64 and int64, such as np.float32, or a NaN or infinite value), and {name} is "
                f"needed as a Python float when the call is traced. Pass {name}=float({name}) outside the compiled "
                f"function (NumPy scalars of any dtype are read in eager calls and by torch.export)."
            )
        return value
    return x


def float_arg(op: str, name: str, x, *, optional: bool = False):
    """``x`` as a pybind11 ``float`` parameter takes it: an int or float (NumPy scalars too), a one-element real
    tensor (read in eager calls); a SymInt/SymFloat passes through; ``None`` when ``optional``."""
    if x is None and optional:
        return None
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_complex() or x.dtype == torch.bool:
            raise ValueError(
                f"{op}: {name} must be a float; a tensor {name} must hold one real element, got a tensor of shape "
                f"{tuple(x.shape)} and dtype {x.dtype}."
            )
        if tracing(x):
            _refuse_traced(op, name, "float", f"{name}=float({name})")
        return float(x)
    if isinstance(x, _SYM[:2]):
        return x
    if isinstance(x, (int, float)):  # before hasattr, which Dynamo cannot trace on a number it made symbolic
        return float(x)
    x = python_float(op, name, x)
    if isinstance(x, float):
        return x
    if isinstance(x, (str, bytes, complex)) or not hasattr(x, "__float__"):
        raise ValueError(
            f"{op}: {name} must be a float{' or None' if optional else ''} (an int, a float or a one-element tensor, "
            f"as FlashAttention accepts), got {type(x).__name__} {x!r}."
        )
    return float(x)


def bool_arg(op: str, name: str, x):
    """``x`` as a pybind11 ``bool`` parameter takes it (its truth value: ``None`` and ``0`` are False); a
    one-element tensor is read in eager calls; a SymBool passes through."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(
                f"{op}: {name} must be a bool; a tensor {name} must hold one element, got shape {tuple(x.shape)}."
            )
        if tracing(x):
            _refuse_traced(op, name, "bool", f"{name}=bool({name})")
        return bool(x)
    if isinstance(x, torch.SymBool):
        return x
    return bool(x)


WINDOW_FORMS = "a tuple or list of two ints or a 2-element integer tensor, as FlashAttention accepts"


def _not_a_pair(op: str, got: str) -> ValueError:
    return ValueError(
        f"{op}: window_size must be a pair (left, right), each -1 (unbounded) or >= 0, given as {WINDOW_FORMS}; got "
        f"{got}. Pass e.g. (-1, -1) for no window or (left, 0) for a causal sliding window."
    )


def window_arg(op: str, window_size) -> tuple:
    """``window_size`` as ``(left, right)`` Python ints (SymInts pass through), in every form FlashAttention
    accepts: a tuple or list of two ints (or NumPy integers, or one-element integer tensors), or a 2-element integer
    tensor. Each bound must be -1 (unbounded) or >= 0."""
    if isinstance(window_size, torch.Tensor):
        if window_size.dim() != 1 or window_size.shape[0] != 2 or not _integral_tensor(window_size):
            raise _not_a_pair(op, f"a tensor of shape {tuple(window_size.shape)} and dtype {window_size.dtype}")
        if tracing(window_size):
            _refuse_traced(op, "window_size", "tuple of two ints", "window_size=tuple(window_size.tolist())")
        pair = tuple(int(w) for w in window_size.tolist())
    elif isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        if any(isinstance(w, torch.Tensor) and w.numel() == 1 and tracing(w) for w in window_size):
            _refuse_traced(op, "window_size", "tuple of two ints", "window_size=(int(left), int(right))")
        try:
            pair = tuple(int_arg(op, "window_size", w) for w in window_size)
        except ValueError:
            raise _not_a_pair(op, repr(window_size)) from None
    else:
        raise _not_a_pair(op, repr(window_size))
    if pair[0] < -1 or pair[1] < -1:
        raise ValueError(
            f"{op}: window_size={pair}: each bound must be -1 (unbounded) or >= 0 (FlashAttention's (left, right) "
            f"local window)."
        )
    return pair

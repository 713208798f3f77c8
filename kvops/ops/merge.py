"""Merging attention states: ``kvops::merge_attention_states`` and ``kvops::merge_attention_states_many``.

The exact merge of partial attentions of the same queries over disjoint key sets (docs/semantics.md §12), as
FlashInfer's ``merge_state``/``merge_states`` and vLLM's ``merge_attn_states``: the step that joins a cascade's levels
(``kvops.cascade_attention``, docs/cascade.md) or a split-KV decode's splits.

Schema: ``kvops/_library.py``. Validator: ``kvops/_checks/merge.py``. CPU kernel: ``kvops/cpu/merge.py`` (a torch
composite). CUDA kernel: ``kvops/triton/merge.py``. Under ``torch.compile`` the ops decompose into the CPU kernel's
pointwise torch ops (``lowering/inductor_merge.py``), so Inductor fuses the merge into one loop, with its consumers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _library  # noqa: F401  (defines the schemas)
from .._checks.merge import OP_MANY, check_merge_attention_states, check_merge_attention_states_many
from ..cpu import merge as cpu
from ..triton import HAS_TRITON


def merge_attention_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions of the same queries over disjoint key sets into the attention over their union.

    With ``m = max(lse_a, lse_b)`` (0 where both parts are empty), ``w_x = exp(lse_x - m)``, ``s = w_a + w_b``:
    ``lse = m + log(s)``, ``out = (w_a * o_a + w_b * o_b) / s``: exactly softmax attention over the union of the two
    key sets (FlashInfer's ``merge_state``, vLLM's ``merge_attn_states``; docs/semantics.md §12). fp32 math, ``out``
    rounded once to the parts' dtype.

    Args:
        o_a, o_b: ``[T, H, D_v]`` float32/bfloat16/float16, one dtype and shape (any strides): the two parts'
            attention outputs, e.g. ``kvops.paged_attention(..., return_lse=True)[0]``.
        lse_a, lse_b: ``[H, T]`` float32, natural log: the parts' log-sum-exp, as ``kvops.paged_attention`` (and
            FlashAttention's varlen ``softmax_lse``, vLLM's ``merge_attn_states``) lay it out. FlashInfer's ``[T, H]``
            LSE is passed as its transposed view ``lse.t()`` (no copy; the kernels take strides). An empty part (no
            key) has LSE ``-inf`` (``+inf``, FlashAttention-2's value for it, is read as ``-inf``, as vLLM does) and
            contributes nothing; its ``out`` must be finite (kvops, FlashAttention and FlashInfer write 0 there), as
            it enters with weight 0.

    Returns:
        ``(out [T, H, D_v]`` in the parts' dtype, ``lse [H, T]`` float32). Both parts empty: ``out = 0``,
        ``lse = -inf`` (no NaN). A NaN LSE (a NaN score in that part) makes the row's out and LSE NaN.

    Raises:
        ValueError: ``o_a``/``o_b`` not 3-D, not float32/bfloat16/float16, of different shapes, dtypes or devices;
        ``lse_a``/``lse_b`` not float32, not of shape ``[H, T]`` (a ``[T, H]`` LSE gets the ``.t()`` fix), or on
        another device. Raised by the fake rule too (trace time under ``torch.compile`` and ``torch.export``); a
        failing call changes nothing.
    """
    if _direct((o_a, lse_a, o_b, lse_b)):
        check_merge_attention_states(o_a, lse_a, o_b, lse_b)
        return cpu.merge_attention_states(o_a, lse_a, o_b, lse_b)
    return torch.ops.kvops.merge_attention_states(o_a, lse_a, o_b, lse_b)


def merge_attention_states_many(outs: torch.Tensor | Sequence[torch.Tensor],
                                lses: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``N >= 1`` partial attentions of the same queries over pairwise disjoint key sets (FlashInfer's
    ``merge_states``; docs/semantics.md §12): ``m = max_i lse_i``, ``w_i = exp(lse_i - m)``, ``s = sum_i w_i``,
    ``lse = m + log(s)``, ``out = sum_i w_i * out_i / s``, in fp32.

    Args:
        outs: ``[N, T, H, D_v]`` float32/bfloat16/float16 (any strides), or a sequence of ``N`` tensors
            ``[T, H, D_v]`` (stacked first: one copy).
        lses: ``[N, H, T]`` float32 natural-log LSEs (kvops' layout; FlashInfer's ``[T, N, H]`` stacked ``s`` is
            ``s.permute(1, 2, 0)``, a view), or a sequence of ``N`` tensors ``[H, T]``. Empty parts (LSE
            ``-inf``, or ``+inf`` read as ``-inf``) contribute nothing.

    Returns:
        ``(out [T, H, D_v]`` in the parts' dtype, ``lse [H, T]`` float32); every part empty: ``out = 0``,
        ``lse = -inf``.

    Raises:
        ValueError: ``outs`` not 4-D float32/bfloat16/float16 or with ``N = 0``; ``lses`` not float32 of shape
        ``[N, H, T]`` or on another device; a sequence whose parts differ in shape or dtype (naming the part).
        Raised by the fake rule too; a failing call changes nothing.
    """
    if not isinstance(outs, torch.Tensor):
        outs = _stack("outs", outs)
    if not isinstance(lses, torch.Tensor):
        lses = _stack("lses", lses)
    if _direct((outs, lses)):
        check_merge_attention_states_many(outs, lses)
        return cpu.merge_attention_states_many(outs, lses)
    return torch.ops.kvops.merge_attention_states_many(outs, lses)


def _stack(name: str, parts) -> torch.Tensor:
    """``torch.stack`` of a sequence of parts, with an error naming the part that differs (torch's names none)."""
    parts = tuple(parts)
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"{OP_MANY}: {name}[{i}] is a {type(p).__name__}, not a tensor. Pass tensors.")
        if i and (p.shape != parts[0].shape or p.dtype != parts[0].dtype):
            raise ValueError(
                f"{OP_MANY}: {name}[{i}] has shape {tuple(p.shape)} and dtype {p.dtype} but {name}[0] has shape "
                f"{tuple(parts[0].shape)} and dtype {parts[0].dtype}. Pass parts of one shape and dtype (or a "
                f"stacked tensor)."
            )
    if not parts:
        raise ValueError(f"{OP_MANY}: {name} holds no parts; pass at least one part (N >= 1).")
    return torch.stack(parts)


def _direct(tensors) -> bool:
    """Whether an eager call may run the validator and the CPU kernel without the dispatcher (the same checks and
    results, ~30 us less per call, what a decode step's merge spends on per-call costs; as ``kvops.paged_attention``
    does): plain CPU tensors without autograd, nothing tracing, no dispatch or function mode, functorch transform
    or profiler active (a profile or a mode still sees ``kvops::merge_attention_states``)."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch.autograd._profiler_enabled() or torch._C._is_torch_function_mode_enabled()
            or torch._C._functorch.peek_interpreter_stack() is not None):
        return False
    grad = torch.is_grad_enabled()
    return all(type(t) is torch.Tensor and t.is_cpu and not (grad and t.requires_grad) for t in tensors)


# --- fake rules: the contract at trace time ---------------------------------------------------------------------
@torch.library.register_fake("kvops::merge_attention_states")
def _merge_two_fake(o_a, lse_a, o_b, lse_b):
    check_merge_attention_states(o_a, lse_a, o_b, lse_b)
    t, h, d = o_a.shape
    return o_a.new_empty((t, h, d)), lse_a.new_empty((h, t))


@torch.library.register_fake("kvops::merge_attention_states_many")
def _merge_many_fake(outs, lses):
    check_merge_attention_states_many(outs, lses)
    _, t, h, d = outs.shape
    return outs.new_empty((t, h, d)), lses.new_empty((h, t))


# --- kernels ----------------------------------------------------------------------------------------------------
def _register(device: str, kernels) -> None:
    @torch.library.impl("kvops::merge_attention_states", device)
    def _merge_two(o_a, lse_a, o_b, lse_b):
        check_merge_attention_states(o_a, lse_a, o_b, lse_b)
        return kernels.merge_attention_states(o_a, lse_a, o_b, lse_b)

    @torch.library.impl("kvops::merge_attention_states_many", device)
    def _merge_many(outs, lses):
        check_merge_attention_states_many(outs, lses)
        return kernels.merge_attention_states_many(outs, lses)


_register("CPU", cpu)
if HAS_TRITON:
    from ..triton import merge as _triton_merge

    _register("CUDA", _triton_merge)

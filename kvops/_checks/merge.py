"""Validators of ``kvops::merge_attention_states`` and ``kvops::merge_attention_states_many`` (docs/cascade.md,
docs/semantics.md §12), shared by the eager kernels and the fake rules.

Layouts are kvops' (``kvops.paged_attention(return_lse=True)``): a part's ``out [T, H, D_v]`` and ``lse [H, T]``
float32 in natural log; the many-way form stacks ``N`` parts: ``outs [N, T, H, D_v]``, ``lses [N, H, T]``.
FlashInfer's LSE layout ``[T, H]`` is accepted as its transposed view ``lse.t()`` (the kernels take strides); a
``[T, H]`` tensor passed as is (``T != H``) gets an error saying so, and with ``T == H`` it is read as ``[H, T]``.
Shapes and dtypes only: never tensor contents (no host syncs).
"""

from __future__ import annotations

import torch

from .common import as_int, require_same_device

OP_TWO = "kvops.merge_attention_states"
OP_MANY = "kvops.merge_attention_states_many"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_out(op: str, name: str, o: torch.Tensor, ndim: int, layout: str) -> None:
    if o.dim() != ndim:
        raise ValueError(
            f"{op}: {name} must be {ndim}-D {layout} (kvops.paged_attention's out), got shape {tuple(o.shape)}. "
            f"Pass the attention output of each part with shape {layout}."
        )
    if o.dtype not in _FLOATS:
        raise ValueError(
            f"{op}: {name} must be float32, bfloat16 or float16, got {o.dtype}. Pass the attention output in the "
            f"model's floating dtype."
        )


def _check_lse(op: str, name: str, lse: torch.Tensor, want: tuple, layout: str, out_name: str, o) -> None:
    if lse.dtype != torch.float32:
        raise ValueError(
            f"{op}: {name} must be float32 (the log-sum-exp in natural log, as kvops.paged_attention returns it), "
            f"got {lse.dtype}. Pass {name}.float()."
        )
    have = tuple(lse.shape)
    if have != want:
        flipped = want[:-2] + (want[-1], want[-2])
        view = f"{name}.t()" if len(want) == 2 else f"{name}.transpose(-1, -2)"
        fix = (f"This is FlashInfer's [T, H] layout: pass its transposed view {view} (no copy)." if have == flipped else
               f"Pass the LSE that came with {out_name} (kvops.paged_attention(..., return_lse=True) returns it "
               f"as [H, T]).")
        raise ValueError(
            f"{op}: {name} must have shape {layout} = {tuple(as_int(s) for s in want)} to match {out_name} of shape "
            f"{tuple(as_int(s) for s in o.shape)}, got {have}. {fix}"
        )
    require_same_device(op, name, lse, out_name, o)


def check_merge_attention_states(o_a, lse_a, o_b, lse_b) -> None:
    """Two parts over disjoint key sets: ``o_a``/``o_b`` ``[T, H, D_v]`` of one float dtype and shape, ``lse_a``/
    ``lse_b`` float32 ``[H, T]`` on the same device. Raises ``ValueError`` naming the argument, its value and the fix.
    """
    s = o_a.shape
    if (len(s) == 3 and o_a.dtype in _FLOATS and o_b.dtype == o_a.dtype and o_b.shape == s
            and lse_a.dtype == torch.float32 and lse_b.dtype == torch.float32 and lse_a.shape == (s[1], s[0])
            and lse_b.shape == lse_a.shape and o_a.device == o_b.device == lse_a.device == lse_b.device):
        return  # valid (one pass over the facts: a decode step's merge pays ~2 us for its checks)
    _check_out(OP_TWO, "o_a", o_a, 3, "[T, H, D_v]")
    _check_out(OP_TWO, "o_b", o_b, 3, "[T, H, D_v]")
    if o_b.shape != o_a.shape:
        raise ValueError(
            f"{OP_TWO}: o_b shape {tuple(o_b.shape)} does not match o_a shape {tuple(o_a.shape)}. Both parts must be "
            f"attention outputs of the same queries [T, H, D_v] (over disjoint key sets)."
        )
    if o_b.dtype != o_a.dtype:
        raise ValueError(
            f"{OP_TWO}: o_b dtype {o_b.dtype} does not match o_a dtype {o_a.dtype}. Cast o_b to {o_a.dtype}."
        )
    require_same_device(OP_TWO, "o_b", o_b, "o_a", o_a)
    want = (o_a.shape[1], o_a.shape[0])
    _check_lse(OP_TWO, "lse_a", lse_a, want, "[H, T]", "o_a", o_a)
    _check_lse(OP_TWO, "lse_b", lse_b, want, "[H, T]", "o_a", o_a)


def check_merge_attention_states_many(outs, lses) -> None:
    """``N >= 1`` stacked parts: ``outs [N, T, H, D_v]`` float, ``lses [N, H, T]`` float32, one device. Raises
    ``ValueError`` naming the argument, its value and the fix."""
    _check_out(OP_MANY, "outs", outs, 4, "[N, T, H, D_v]")
    if outs.shape[0] == 0:
        raise ValueError(
            f"{OP_MANY}: outs holds no parts (shape {tuple(outs.shape)}); pass at least one part (N >= 1)."
        )
    want = (outs.shape[0], outs.shape[2], outs.shape[1])
    _check_lse(OP_MANY, "lses", lses, want, "[N, H, T]", "outs", outs)

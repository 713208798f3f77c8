"""CPU kernels of ``kvops::merge_attention_states`` and ``kvops::merge_attention_states_many``: torch composites.

The merge of parts over disjoint key sets (docs/semantics.md §12; FlashInfer's ``merge_state``/``merge_states``,
vLLM's ``merge_attn_states``): with ``m = max_i lse_i`` (``0`` where every part is empty),
``w_i = exp(lse_i - m)``, ``s = sum_i w_i``::

    lse = m + log(s)            out = sum_i (w_i / s) * out_i     (0 where s == 0)

in fp32, rounded once to the parts' dtype (computed as ``lse = logaddexp(lse_a, lse_b)`` / ``logsumexp`` and
weights ``exp(lse_i - lse)``, the same values). An LSE of ``+inf`` (FlashAttention-2's value for a query with no key) is
read as ``-inf``, as vLLM does. Functional aten ops only (no host syncs, no in-place writes), so the same functions
serve as Inductor's decompositions of the ops (``lowering/`` registers them), where the whole merge fuses into one
loop.
"""

from __future__ import annotations

import torch

_INF = float("inf")
_LOWEST = torch.finfo(torch.float32).min


def _empty_as_minus_inf(lse):
    """``+inf`` (FlashAttention-2's LSE of a part with no key; vLLM's reading) -> ``-inf``; NaN stays NaN."""
    return torch.nan_to_num(lse, nan=float("nan"), posinf=-_INF, neginf=-_INF)


def _weight(lse_i, lse_safe):
    """``exp(lse_i - lse)``, the part's weight: ``lse_safe`` is the merged LSE clamped to the lowest finite float, so
    where every part is empty the weights are ``exp(-inf) = 0`` rather than NaN."""
    return torch.exp(lse_i - lse_safe).transpose(-1, -2).unsqueeze(-1)  # [..., T, H, 1]


def merge_attention_states(o_a, lse_a, o_b, lse_b):
    """``(out [T, H, D_v] in o_a's dtype, lse [H, T] float32)`` of two parts (validated)."""
    la, lb = _empty_as_minus_inf(lse_a), _empty_as_minus_inf(lse_b)
    lse = torch.logaddexp(la, lb)  # -inf where both are -inf
    lse_safe = lse.clamp(min=_LOWEST)
    out = torch.addcmul(o_a.float() * _weight(la, lse_safe), o_b.float(), _weight(lb, lse_safe))
    return out.to(o_a.dtype).contiguous(), lse.contiguous()


def merge_attention_states_many(outs, lses):
    """``(out [T, H, D_v] in outs' dtype, lse [H, T] float32)`` of ``N`` stacked parts (validated)."""
    lses = _empty_as_minus_inf(lses)
    lse = torch.logsumexp(lses, 0)  # -inf where every part is -inf
    c = _weight(lses, lse.clamp(min=_LOWEST))  # [N, T, H, 1]
    out = outs[0].float() * c[0]
    for i in range(1, outs.shape[0]):
        out = torch.addcmul(out, outs[i].float(), c[i])
    return out.to(outs.dtype).contiguous(), lse.contiguous()

"""fp64 oracle of attention over a key subset and of the merge (tests only: no runtime module imports it).

``partial_attention`` computes softmax attention of queries over an explicit subset of keys in fp64, returning the
part's ``(out, lse)`` in kvops' layouts; the merge of parts over disjoint subsets must equal the attention over their
union (docs/semantics.md §12). ``merge_states`` is the merge written directly from ``logsumexp`` in fp64.
"""

from __future__ import annotations

import torch


def partial_attention(q, k, v, visible, scale):
    """``q [T, H_q, D]``, ``k [L, H_kv, D]``, ``v [L, H_kv, D_v]``, ``visible [T, L]`` bool (the part's keys of each
    query). Returns fp64 ``(out [T, H_q, D_v], lse [H_q, T])``; a query with no visible key: ``out = 0``,
    ``lse = -inf``. GQA: query head ``h`` reads KV head ``h // (H_q // H_kv)``."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, 1)
    vv = v.double().repeat_interleave(group, 1)
    s = torch.einsum("thd,lhd->htl", q.double(), kk) * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [H, T]; -inf where nothing is visible
    p = torch.exp(s - torch.where(lse == float("-inf"), 0.0, lse)[..., None])
    return torch.einsum("htl,lhd->thd", p, vv), lse


def merge_states(outs, lses):
    """fp64 merge of ``N`` parts (``outs [N, T, H, D_v]``, ``lses [N, H, T]``; ``+inf`` read as ``-inf``)."""
    lses = lses.double()
    lses = torch.where(lses == float("inf"), float("-inf"), lses)
    lse = torch.logsumexp(lses, 0)
    w = torch.exp(lses - torch.where(lse == float("-inf"), 0.0, lse)[None])  # [N, H, T]
    return torch.einsum("nht,nthd->thd", w, outs.double()), lse

"""Rotary embeddings where the cache is written: ``kvops::rotary_paged_cache_write`` and :func:`apply_rotary`.

Semantics (docs/semantics.md §8) are FlashAttention's ``flash_attn_with_kvcache`` rotary arguments (``rotary_cos``,
``rotary_sin``, ``rotary_interleaved``, ``rotary_dim = 2 * rotary_cos.shape[1] <= head_dim``): see
``kvops/cpu/rotary.py``.

Schema: ``kvops/_library.py``. Validator: ``kvops/_checks/rotary.py``. CPU kernel: ``kvops/cpu/rotary.py``.
CUDA kernel: ``kvops/triton/rotary.py``. Inductor lowering: ``lowering/inductor_rotary.py`` (the rotation is computed
inside the cache-store loop, fused with the producer of the key).
"""

from __future__ import annotations

import torch

from .. import _library  # noqa: F401  (defines the schemas)
from .._checks import values
from .._checks.common import require_scale_tensor
from .._checks.rotary import OP, check_rotary, check_rotary_paged_cache_write
from ..cpu import rotary as cpu
from ..cpu.paged_write import unaliased
from ..triton import HAS_TRITON


def rotary_paged_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    rotary_cos: torch.Tensor,
    rotary_sin: torch.Tensor,
    rotary_interleaved: bool = False,
    cache_head_start: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Rotate ``key`` at ``positions`` and write key/value into a paged cache at ``slot_mapping``, in place.

    ``kvops.paged_cache_write`` (docs/semantics.md §3: negative slot = skip, head slices, fp8 caches with scales) whose key
    is first rotated as FlashAttention's ``flash_attn_with_kvcache`` rotates the appended ``k``: token ``i``'s first
    ``rotary_dim`` dims at position ``positions[i]``; GPT-NeoX pairs ``(j, j + rotary_dim / 2)`` or, with
    ``rotary_interleaved=True``, GPT-J pairs ``(2j, 2j + 1)``; fp32 math, rounded once to the key's dtype (before
    fp8 quantization). A contiguous cache ``[B, S, H, D]`` is the paged form with ``B`` blocks of ``block_size = S``.

    Args:
        key: ``[N', H_in, D]`` (rows ``>= N`` ignored). value: ``[N', H_in, D_v]``.
        k_cache, v_cache: ``[P, block_size, H_kv, D]`` / ``D_v`` (any strides); mutated. NHD only: for an HND cache
            ``[P, H_kv, block_size, D]`` pass its NHD view ``cache.transpose(1, 2)`` (no copy; ambiguous when
            ``H_kv == block_size``: read as NHD).
        slot_mapping: ``[N]`` int32/int64, ``block * block_size + row`` or negative (skip).
        positions: ``[>= N]`` int32/int64 rotary positions, ``0 <= positions[i] < seqlen_ro``: a value contract
            (docs/semantics.md §7) checked per the value-check mode (``"eager"``: a ``RuntimeError`` naming
            ``positions[i]``, its value and ``seqlen_ro`` before anything is written); unchecked (``"off"``,
            compiled code in ``"eager"`` mode) the CPU kernel raises ``IndexError`` with the same facts, CUDA is
            undefined.
        rotary_cos, rotary_sin: ``[seqlen_ro, rotary_dim / 2]``, key's dtype.
        rotary_interleaved: GPT-J pairs (FlashAttention's default in ``flash_attn_with_kvcache`` is ``True``; here
            the default is GPT-NeoX, the Llama/Qwen/Mistral convention).
        cache_head_start, k_scale, v_scale: as ``kvops.paged_cache_write``.

    Raises:
        ValueError: every error of ``kvops.paged_cache_write`` (under this op's name; its "may be an HND cache" hint
            says this op takes NHD caches only and how to get an NHD view); tables not 2-D or of different
            shapes or dtypes other than key's; ``rotary_dim`` 0 or ``> head_dim`` (``"rotary_dim must be <=
            headdim"``); ``positions`` not 1-D int32/int64 with ``>= N`` entries.

    ``key``/``value`` may alias the caches: they are read before anything is written, as in compiled code (the
    kernels copy such a source first; docs/semantics.md §3).
    """
    for _name, _scale in (("k_scale", k_scale), ("v_scale", v_scale)):  # a float: a clear error
        require_scale_tensor(OP, _name, _scale, "float32 tensor of shape [1] or [H_kv]")
    try:  # value contract (docs/semantics.md §7): positions within the tables
        values.check_rotary_positions(positions, slot_mapping.shape[0], rotary_cos, OP)
    except RuntimeError:  # a metadata error explains it better: it goes first
        check_rotary_paged_cache_write(key, value, k_cache, v_cache, slot_mapping, positions, rotary_cos, rotary_sin,
                                       rotary_interleaved, cache_head_start, k_scale, v_scale)
        raise
    torch.ops.kvops.rotary_paged_cache_write(key, value, k_cache, v_cache, slot_mapping, positions, rotary_cos,
                                             rotary_sin, rotary_interleaved, cache_head_start, k_scale, v_scale)


def apply_rotary(x: torch.Tensor, rotary_cos: torch.Tensor, rotary_sin: torch.Tensor, positions: torch.Tensor,
                 rotary_interleaved: bool = False) -> torch.Tensor:
    """``x [..., H, D]`` with its first ``rotary_dim`` dims rotated at ``positions`` (shape ``x.shape[:-2]``).

    The same rotation as :func:`rotary_paged_cache_write` (FlashAttention semantics), as plain torch ops (a composite,
    so Inductor fuses it with its producer and consumer): used for queries, and for keys stored before RoPE and
    rotated at read time (StreamingLLM-style caches with sink tokens, whose kept keys take the positions they have
    *within the cache*). Returns a new tensor in ``x``'s dtype.

    Raises ``ValueError`` for tables that are not 2-D of one shape and ``x``'s dtype, ``rotary_dim > head_dim``, or
    ``positions`` whose shape is not ``x.shape[:-2]`` or dtype not int32/int64.
    """
    if tuple(positions.shape) != tuple(x.shape[:-2]):
        want = list(x.shape[:-2])
        have = list(positions.shape)
        expands = len(have) <= len(want) and all(a in (1, b) for a, b in zip(have[::-1], want[::-1]))
        fix = (f"Pass positions.expand({want}) (the same positions for every sequence)." if expands else
               f"Pass one position per token of x: a tensor of shape {want}.")
        raise ValueError(
            f"kvops.apply_rotary: positions must have shape x.shape[:-2] = {tuple(x.shape[:-2])} (one position per "
            f"token), got {tuple(positions.shape)}. {fix}"
        )
    check_rotary("kvops.apply_rotary", "x", x, rotary_cos, rotary_sin, positions.reshape(-1), positions.numel())
    values.check_rotary_positions(positions.reshape(-1), positions.numel(), rotary_cos, "kvops.apply_rotary")
    return cpu.apply_rotary(x, rotary_cos, rotary_sin, positions.long(), rotary_interleaved)


# --- fake rule: the contract at trace time ----------------------------------------------------------------------
@torch.library.register_fake("kvops::rotary_paged_cache_write")
def _rotary_paged_cache_write_fake(key, value, k_cache, v_cache, slot_mapping, positions, rotary_cos, rotary_sin,
                                   rotary_interleaved=False, cache_head_start=None, k_scale=None, v_scale=None):
    check_rotary_paged_cache_write(key, value, k_cache, v_cache, slot_mapping, positions, rotary_cos, rotary_sin,
                                   rotary_interleaved, cache_head_start, k_scale, v_scale)


# --- kernels ----------------------------------------------------------------------------------------------------
def _register(device: str, kernels) -> None:
    @torch.library.impl("kvops::rotary_paged_cache_write", device)
    def _write(key, value, k_cache, v_cache, slot_mapping, positions, rotary_cos, rotary_sin,
               rotary_interleaved=False, cache_head_start=None, k_scale=None, v_scale=None):
        h0 = check_rotary_paged_cache_write(key, value, k_cache, v_cache, slot_mapping, positions, rotary_cos,
                                            rotary_sin, rotary_interleaved, cache_head_start, k_scale, v_scale)
        key, value = unaliased(key, k_cache, v_cache), unaliased(value, k_cache, v_cache)  # snapshot (§3)
        kernels.rotary_paged_cache_write(key, value, k_cache, v_cache, slot_mapping, positions, rotary_cos,
                                         rotary_sin, rotary_interleaved, h0, k_scale, v_scale)


_register("CPU", cpu)
if HAS_TRITON:
    from ..triton import rotary as _triton_rotary

    _register("CUDA", _triton_rotary)

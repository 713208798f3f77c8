"""Triton kernel for ``kvops::paged_cache_write``: one program per token, strided, fp8 quantization in the kernel.

As vLLM's ``reshape_and_cache_flash``: token ``i`` with slot ``x = slot_mapping[i]`` lands in block
``x // block_size``, row ``x % block_size``; a negative slot is padding and writes nothing. Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _paged_scatter_kernel(
    src_ptr, cache_ptr, slot_ptr, scale_ptr,
    H, D, block_size,
    s_n, s_h, s_d,
    c_p, c_b, c_h, c_d,
    head0, scale_stride,
    QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ``i``: ``cache[slot // block_size, slot % block_size, head0 + :H, :D] = src[i, :H, :D]``."""
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    valid = slot >= 0
    blk = slot // block_size
    row = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :].to(tl.int64)
    mask = (h < H) & (d < D) & valid
    x = tl.load(src_ptr + i * s_n + h * s_h + d * s_d, mask=mask, other=0.0)
    if QUANT:
        scale = tl.load(scale_ptr + (head0 + h) * scale_stride, mask=h < H, other=1.0)
        y = tl.math.div_rn(x.to(tl.float32), scale)
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        x = y.to(cache_ptr.dtype.element_ty)
    tl.store(cache_ptr + blk * c_p + row * c_b + (head0 + h) * c_h + d * c_d, x, mask=mask)


def scatter_tokens(
    src: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, h0: int, scale: torch.Tensor | None
) -> None:
    """Scatter ``src [N', H_in, D]`` rows ``[0, N)`` into ``cache [P, block_size, H_kv, D]`` (any strides)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    _, h, d = src.shape
    scale_arg = scale if scale is not None else slot_mapping  # unused pointer when QUANT is off
    scale_stride = 0 if scale is None or scale.shape[0] == 1 else scale.stride(0)
    _paged_scatter_kernel[(n,)](
        src, cache, slot_mapping, scale_arg,
        h, d, cache.shape[1],
        *src.stride(), *cache.stride(),
        h0, scale_stride,
        QUANT=scale is not None, FP8_MAX=FP8_MAX,
        BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d),
    )


def paged_cache_write(key, value, k_cache, v_cache, slot_mapping, h0: int, k_scale, v_scale) -> None:
    """Launcher with the CPU kernel's signature (arguments already validated). Slots ``>= P * block_size`` are not
    checked here (no host sync): they are undefined behaviour, as in vLLM; use ``kvops.check_slot_mapping``."""
    scatter_tokens(key, k_cache, slot_mapping, h0, k_scale)
    scatter_tokens(value, v_cache, slot_mapping, h0, v_scale)

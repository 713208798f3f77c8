"""``PagedMLACache``: per-layer paged MLA latent caches with ``PagedKVCache``'s block manager (docs/mla.md).

Each layer holds one latent cache ``[P, block_size, kv_lora_rank + rope_dim]`` (DeepSeek-V2/V3's compressed
``[kv_c | k_pe]`` rows); sequences, blocks, forks and the per-step metadata (:meth:`prepare`, a ``PagedStep``) are
``PagedKVCache``'s, unchanged. Writes go through ``kvops.mla_cache_write``, reads through ``kvops.mla_attention``.
"""

from __future__ import annotations

import torch

from .._checks.common import FP8_DTYPE
from .._checks.mla import check_kv_scale, require_scale_tensor
from ..ops.mla import mla_attention, mla_cache_write
from ._alloc import allocate
from .paged import PagedKVCache, PagedStep


class PagedMLACache(PagedKVCache):
    """Paged latent caches of an MLA model (one latent "head" per token, shared by every query head).

    The block manager is :class:`PagedKVCache`'s (``add_sequence``, ``extend``, ``prepare``, ``fork``, ``free``,
    ``block_table``, ``step_at``; the same :class:`PagedStep`); only the storage and the two tensor methods differ:
    :meth:`write` takes ``kv_c``/``k_pe`` and :meth:`attention` the absorbed query.

    Args:
        num_blocks: ``P``, physical blocks per layer. block_size: rows per block.
        kv_lora_rank: the compressed KV width (512 for DeepSeek-V3). rope_dim: ``qk_rope_head_dim`` (64).
        num_layers: latent caches allocated (``kv_caches[l]``).
        dtype, device: of the caches (``None``: torch's defaults); ``torch.float8_e4m3fn`` needs ``kv_scale``.
        kv_scale: float32 scalar tensor (``[]`` or ``[1]``) on the caches' device, the per-tensor scale of an fp8
            cache (stores ``x / kv_scale``), passed to both ops; only for an fp8 cache. A tensor, as the ops take
            it (vLLM's layers hold ``_k_scale`` as one too): a Python float is refused, ``torch.tensor(s,
            dtype=torch.float32)`` is the fix.

    Raises:
        ValueError: non-positive sizes; caches needing more than ``2**47`` bytes; an fp8 ``dtype`` without
            ``kv_scale``, a ``kv_scale`` that is not a float32 scalar tensor on the caches' device or given for a
            non-fp8 cache (at construction, not at the first write); from the methods, every error of
            the block manager and of the two ops (``kvops.mla_cache_write``, ``kvops.mla_attention``).
    """

    def __init__(self, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int, *, num_layers: int = 1,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 kv_scale: torch.Tensor | None = None) -> None:
        for name, x in (("num_blocks", num_blocks), ("block_size", block_size), ("kv_lora_rank", kv_lora_rank),
                        ("num_layers", num_layers)):
            if isinstance(x, bool) or not isinstance(x, int) or x <= 0:
                raise ValueError(f"PagedMLACache: {name} must be a positive int, got {x!r}.")
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim < 0:
            raise ValueError(f"PagedMLACache: rope_dim must be an int >= 0, got {rope_dim!r}.")
        require_scale_tensor("PagedMLACache", kv_scale)
        if dtype == FP8_DTYPE and kv_scale is None:
            raise ValueError(
                f"PagedMLACache: dtype={FP8_DTYPE} needs kv_scale (the float32 per-tensor scale: the cache holds "
                f"x / kv_scale), got kv_scale=None. Pass kv_scale=torch.tensor(s, dtype=torch.float32) to "
                f"PagedMLACache (it is passed to every write and attention)."
            )
        sizes = dict(num_blocks=num_blocks, block_size=block_size, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                     num_layers=num_layers)
        shape = (num_blocks, block_size, kv_lora_rank + rope_dim)
        self.kv_caches: list[torch.Tensor] = allocate("PagedMLACache", sizes, [shape] * num_layers, dtype, device)
        check_kv_scale("PagedMLACache", self.kv_caches[0], kv_scale)  # shape, dtype, device; none for non-fp8
        self.kv_lora_rank, self.rope_dim, self.kv_scale = kv_lora_rank, rope_dim, kv_scale
        # the block manager's state (PagedKVCache's methods read these)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.window_left, self.sink_tokens = -1, 0
        self.k_scale = self.v_scale = None
        self.k_caches, self.v_caches = self.kv_caches, []  # (layer count for the inherited helpers)
        self.device = self.kv_caches[0].device
        self._free: list[int] = list(range(num_blocks))
        self._refs = [0] * num_blocks
        self._seqs: dict = {}
        self._sliced = [0] * num_layers

    def write(self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor, step: PagedStep, *,
              rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
              rotary_interleaved: bool = False) -> None:
        """Write the step's new latent rows ``kv_c [N_pad, kv_lora_rank]``, ``k_pe [N_pad, rope_dim]`` of ``layer``
        (``kvops.mla_cache_write`` at ``step.slot_mapping``; padding rows skipped). With ``rotary_cos``/``rotary_sin``
        ``k_pe`` is rotated at ``step.positions`` (fused into the write)."""
        self._check_layer("PagedMLACache.write", layer)
        positions = step.positions if rotary_cos is not None or rotary_sin is not None else None
        mla_cache_write(kv_c, k_pe, self.kv_caches[layer], step.slot_mapping, self.kv_scale, positions, rotary_cos,
                        rotary_sin, rotary_interleaved)

    def attention(self, layer: int, q: torch.Tensor, step: PagedStep, *, scale: float | None = None,
                  causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``kvops.mla_attention`` of the absorbed ``q [N_pad, H, kv_lora_rank + rope_dim]`` over ``layer``'s cache
        with the step's metadata: ``(out [N_pad, H, kv_lora_rank], lse [H, N_pad])``."""
        self._check_layer("PagedMLACache.attention", layer)
        return mla_attention(q, self.kv_caches[layer], step.cu_seqlens_q, step.seq_lens, step.block_table,
                             max(step.max_seqlen_q, 1), self.kv_lora_rank, scale=scale, causal=causal,
                             kv_scale=self.kv_scale)

    def _check_layer(self, where: str, layer) -> None:
        num_layers = len(self.kv_caches)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
            raise ValueError(
                f"{where}: layer must be an int in [0, {num_layers}) (the cache holds num_layers={num_layers}), got "
                f"{type(layer).__name__} {layer!r}. Pass the layer's index, or build PagedMLACache with more layers."
            )

"""One exportable decode step over a kvops cache for every position (imported by
``kvops.integrations.transformers``), as transformers' ``TorchExportableModuleWithStaticCache``."""

from __future__ import annotations

import torch

from ._hf_cache import KvopsPagedCache, KvopsSlidingLayer, KvopsStaticCache
from ._hf_checks import check_cache_position


class ExportableDecodeStep(torch.nn.Module):
    """``forward(input_ids, cache_position, attention_mask=None, position_ids=None) -> logits [B, T, V]`` of a model
    with ``attn_implementation="kvops"`` over a :class:`KvopsStaticCache` or :class:`KvopsPagedCache`, written so
    that one ``torch.export`` program serves every position.

    The cache's tensors (K/V storage, the 0-d int64 cursors ``cumulative_length``, the paged block table) are
    registered as non-persistent buffers, as transformers' own export recipe does, and every call first sets each
    layer's cursor from ``cache_position`` (``[T]`` or ``[1]`` int64: the position of the first new token), so the
    position is an input of the program, never a constant baked into it. The cache is initialized here
    (``early_initialization``), before tracing.

    Args:
        model: a causal LM (``model.config._attn_implementation == "kvops"``).
        cache: a fresh or prefilled :class:`KvopsStaticCache` / :class:`KvopsPagedCache` (no sliding-window layers:
            their cursor is a Python int, as in transformers' ``StaticSlidingWindowLayer``, which its own recipe
            replaces for the same reason).
        batch_size: ``B``, needed when ``cache`` is not initialized yet.

    Call arguments: ``input_ids [B, T]``; ``cache_position``; ``attention_mask``: ``None`` (no padding) or a 2-D
    padding mask ``[B, S]`` with ``S >= cache_position[0] + T`` (leading/trailing padding; a fixed ``S =
    max_cache_len`` with zeros past the last token keeps the program's input shapes static); ``position_ids [B, T]``
    (default: ``cache_position`` for every row; pass them for left-padded rows).

    Raises:
        ValueError: a cache with sliding-window layers, another cache type, or no ``batch_size`` for an
            uninitialized cache; (calls) ``cache_position`` of another shape, or (eager) a position outside
            ``[0, max_cache_len - T]``, before any cursor or row is written (traced: a ``torch._assert_async``).
        TypeError: (calls) ``cache_position`` not an integer tensor.
    """

    def __init__(self, model: torch.nn.Module, cache: KvopsStaticCache | KvopsPagedCache,
                 batch_size: int | None = None):
        super().__init__()
        if not isinstance(cache, (KvopsStaticCache, KvopsPagedCache)) or any(
                isinstance(layer, KvopsSlidingLayer) for layer in cache.layers):
            raise ValueError(
                f"ExportableDecodeStep: needs a KvopsStaticCache or KvopsPagedCache without sliding-window layers "
                f"(their cursor is a Python int and would be baked into the program), got {type(cache).__name__} "
                f"with layers {sorted({type(layer).__name__ for layer in cache.layers})}. Build the model config "
                f"without sliding windows for export (as transformers' TorchExportableModuleWithStaticCache does)."
            )
        if not cache.is_initialized:
            if batch_size is None:
                raise ValueError("ExportableDecodeStep: the cache is not initialized; pass batch_size.")
            config = model.config.get_text_config(decoder=True)
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            cache.early_initialization(batch_size, config.num_key_value_heads, head_dim, model.dtype, model.device)
        self.model, self.cache = model, cache
        for i, layer in enumerate(cache.layers):
            if isinstance(cache, KvopsPagedCache):  # one joint allocation per layer: K/V are views taken in update
                self.register_buffer(f"kv_{i}", layer.kv, persistent=False)
            else:
                self.register_buffer(f"k_{i}", layer.k, persistent=False)
                self.register_buffer(f"v_{i}", layer.v, persistent=False)
            self.register_buffer(f"cumulative_length_{i}", layer.cumulative_length, persistent=False)
        if isinstance(cache, KvopsPagedCache):
            self.register_buffer("block_table", cache.block_table, persistent=False)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        layer = self.cache.layers[0]
        check_cache_position(layer.cache_name, cache_position, input_ids.shape[1], layer.max_cache_len)
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(cache_position[0])
        if position_ids is None:
            position_ids = (cache_position[0] + torch.arange(input_ids.shape[1], device=input_ids.device))
            position_ids = position_ids.expand(input_ids.shape[0], -1)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=self.cache, use_cache=True).logits

"""Optional integrations of kvops with other libraries; each module is imported explicitly and needs its extra.

- ``kvops.integrations.transformers`` (``pip install kvops[transformers]``): an attention function and mask function
  registered under ``"kvops"`` in Hugging Face transformers' ``AttentionInterface`` / ``AttentionMaskInterface``,
  and ``Cache`` classes on kvops' contiguous, rolling-window and paged caches.
- ``kvops.integrations.flashinfer`` (no extra): FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (``plan``/``run``)
  on ``kvops.paged_attention``, FlashInfer's semantics without FlashInfer.

``import kvops`` never imports this package (nor transformers).
"""

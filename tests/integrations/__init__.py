"""Tests of the drop-in APIs and model integrations: FlashAttention's and FlashInfer's forms, transformers, gpt-fast (docs/porting.md, docs/transformers.md)."""

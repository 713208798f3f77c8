"""Tests of the paged ops and PagedKVCache: attention (features, layouts, native and Triton kernels, custom masks:
test_tree_mask.py), the cache write, rotary writes, Inductor lowerings (docs/attention_features.md)."""

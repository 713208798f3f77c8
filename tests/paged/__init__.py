"""Tests of the paged-attention family by feature (custom masks: test_tree_mask.py)."""

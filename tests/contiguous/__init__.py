"""Tests of the contiguous-cache ops (cache write, roll, their Triton kernels and Inductor lowerings; docs/semantics.md)."""

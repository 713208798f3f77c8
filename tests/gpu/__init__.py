"""Tests of the GPU tooling that run without a GPU: the ahead-of-time Triton compile, the GPU check script, Triton versions (docs/gpu.md)."""

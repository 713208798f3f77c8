"""Tests of the packed (quantized) cache: its ops, cache class, Triton kernels and compile behaviour (docs/packed-cache.md)."""

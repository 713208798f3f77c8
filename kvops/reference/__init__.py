"""Readable oracles and the CPU kernels of the ops (plain torch, no custom dispatch)."""

"""Composite CPU kernels (torch ops on validated arguments), registered by their ops in ``kvops/ops/``."""

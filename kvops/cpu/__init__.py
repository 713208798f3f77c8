"""Composite CPU kernels (torch ops on validated arguments), registered by their ops in ``kvops/ops/``. Pure ones
(``merge.py``) double as Inductor's decompositions of their ops, so they fuse with their neighbours."""

"""Readable oracles, fp64-capable, that the tests compare every kernel against: ``attention.py`` (paged attention
with every feature of docs/attention_features.md), ``custom_mask.py``, ``merge.py``, ``mla.py``, ``packed.py``.
Written from the definitions, one sequence and one query at a time, sharing no code with the kernels. Nothing in the
runtime imports this package (``tests/project/test_packaging.py`` checks); the CPU kernels are ``kvops/cpu/``."""

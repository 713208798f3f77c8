"""Composite CPU kernels (torch ops on validated arguments), registered by their ops in ``kvops/ops/``:
``paged_attention.py`` (the vectorized fallback of the native kernel, and what AOTInductor packages carry),
``paged_write.py``, ``contiguous.py``, ``rotary.py``, ``transfer.py``, ``merge.py``, ``mla.py``, ``packed.py``. Pure
ones (``merge.py``) double as Inductor's decompositions of their ops, so they fuse with their neighbours. The readable
oracles the tests compare them against are ``kvops/reference/`` (never imported by the runtime)."""

"""Developer tools run from a source tree (``PYTHONPATH=.`` or the repository root as working folder); not part of
the installed ``kvops`` package, which never imports them.

- :mod:`tools.aot`, :mod:`tools.aot_cases`: the ahead-of-time compile check of every Triton kernel kvops launches,
  for real NVIDIA targets without a GPU (``python benchmarks/gpu_check.py --aot``; docs/gpu.md).
"""

"""torch-tensorrt converters (lowering/tensorrt.py). TensorRT cannot be installed on our CPU machines (torch-tensorrt
2.14 pins torch 2.14 and downloads TensorRT from NVIDIA's index), so only the parts that need no TensorRT run here:
``import kvops`` without it, and ``register_tensorrt()`` reporting it unavailable. The converter test skips with that
reason; it checks that the converters register with priority HIGH and accept the functional ops."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import unittest

import torch

import kvops


def _tensorrt_importable() -> bool:
    if importlib.util.find_spec("torch_tensorrt") is None:
        return False
    try:
        import torch_tensorrt  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


class TestWithoutTensorRT(unittest.TestCase):
    def test_import_kvops_does_not_import_torch_tensorrt(self):
        code = ("import sys, kvops, kvops.export; import kvops.lowering; "
                "print('torch_tensorrt' in sys.modules, 'tensorrt' in sys.modules, 'onnxscript' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.split(), ["False", "False", "False"])

    @unittest.skipIf(_tensorrt_importable(), "torch_tensorrt is installed here")
    def test_register_tensorrt_reports_unavailable(self):
        self.assertFalse(kvops.lowering.register_tensorrt())


@unittest.skipUnless(_tensorrt_importable(), "torch_tensorrt/TensorRT is not installable on this CPU machine "
                     "(torch-tensorrt 2.14 needs torch 2.14 and NVIDIA's package index)")
class TestConverters(unittest.TestCase):
    def test_converters_registered_for_the_functional_ops(self):
        from torch_tensorrt.dynamo.conversion._ConverterRegistry import DYNAMO_ATEN_CONVERTERS

        self.assertTrue(kvops.lowering.register_tensorrt())
        from kvops.lowering import tensorrt as trt_lowering

        ops = torch.ops.kvops
        expected = {ops.cache_write_functional.default: trt_lowering.convert_cache_write,
                    ops.cache_roll_functional.default: trt_lowering.convert_cache_roll,
                    ops.paged_cache_write_functional.default: trt_lowering.convert_paged_cache_write}
        for op, fn in expected.items():
            self.assertIs(DYNAMO_ATEN_CONVERTERS[op][0].converter_implementation, fn)  # HIGH: first in the list
            self.assertFalse(DYNAMO_ATEN_CONVERTERS[op][0].supports_dynamic_shapes)


if __name__ == "__main__":
    unittest.main()

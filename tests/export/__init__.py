"""Tests of compile caches, torch.export, AOTInductor, ONNX, TensorRT and the examples' packages (docs/compile.md, docs/deployment.md)."""

"""Importers: turn models from other formats (ONNX, Hugging Face checkpoints, GGUF) into our Graph IR.

``onnx_ops`` maps single ONNX operators to our ops (one converter per ``op_type``); it is the core
of the ONNX model importer and the mapping the ONNX conformance suite runs through.
"""

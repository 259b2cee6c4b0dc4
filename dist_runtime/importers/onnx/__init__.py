"""The ONNX importer: an ONNX graph in, our Graph IR out, one small converter per ONNX ``op_type``.

``model`` is the importer (reading the file, the graph walk, initializers as weights, constant
folding); the converters, one module per family of operators (``elementwise``, ``matmul``,
``layout``, ``norms``, ``conv``, ``resample``, ``embeddings``, ``quant``, ``positions``,
``attention``), register themselves in ``registry`` when this package is imported, and read
their node through ``node.NodeBuilder``.  The registry is also the mapping the conformance suite
(``tests/test_onnx_conformance.py``) runs ONNX's own node test cases through.

A converter is looked up in :data:`CONVERTERS` by ``op_type`` and called as::

    converted = CONVERTERS["Softmax"](node, opset, inputs)

* ``node``: the ``onnx.NodeProto`` (attributes are read with ``onnx.helper.get_attribute_value``);
* ``opset``: the version of the default ONNX domain the model imports;
* ``inputs``: one :class:`OnnxValue` per entry of ``node.input`` (``None`` for an omitted optional
  input, ``""``): its static shape and element type when known, and ``value`` when the tensor is a
  constant known at conversion time (an initializer, a ``Constant``'s output, a folded subgraph).
  The input positions whose *values* a converter needs (Reshape's shape, Split's split, Clip's
  bounds, Resize's scales and sizes, a boolean attention mask...) are listed in
  :data:`CONSTANT_INPUTS`; every other input is consumed at run time by name.

It returns a :class:`Converted`: our nodes in execution order (ids from 0; the caller renumbers
them), whose outputs carry the ONNX output names, intermediates being named
``<node>::<what><n>``; the constants the composition introduced (new weights); and the KV caches
that hold an ONNX ``past_key``/``past_value`` pair (see :class:`KvPriming`).

What our payloads cannot express (asymmetric padding, a softcap, 3-D pooling, an attribute the
converter does not know...) raises :class:`UnsupportedOnnxError` naming the operator and the reason:
a converter never returns nodes that compute something else. Where ONNX semantics differ from
ours by design (docs/ops.md), the converter composes: ``Gemm`` with ``alpha``/``beta``/``C`` is
Matmul, Mul and Add; ``SpaceToDepth`` is PixelUnshuffle followed by a channel permutation;
``Attention``'s top-left causal mask without a cache becomes an explicit additive mask.

:data:`TARGETS` names, per ONNX operator, the ops of ours it exists to exercise (glue such as the
Reshape/Permute around an attention is not counted); the conformance table is built from it.
"""

from . import (attention, conv, elementwise, embeddings, layout, matmul, norms, positions,  # noqa: F401
               quant, resample)
from .registry import (CONSTANT_INPUTS, CONVERTERS, TARGETS, Converted, KvPriming, OnnxValue,
                       UnsupportedOnnxError, convert_node)

__all__ = [
    "CONSTANT_INPUTS", "CONVERTERS", "TARGETS", "Converted", "KvPriming", "OnnxValue",
    "UnsupportedOnnxError", "convert_node",
]

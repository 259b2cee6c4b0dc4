"""``cpu``: the numpy kernel library (``kernels/``), always present and always tried last."""

from __future__ import annotations

from typing import Sequence

from ..ir.graph import Node, TensorSpec
from ..ir.hints import BackendHint
from ..ir.ops import OpPayload
from ..tensor import Array
from . import BoundKernel, register_backend


class CpuBackend:
    """The numpy kernel library: every op, every dtype the kernels accept.  Its table is the
    kernel registry (one kernel per op payload class)."""

    name = "cpu"
    hint = BackendHint.CPU
    batch_invariant = False  # its products and attention are numpy's BLAS calls

    def __init__(self) -> None:
        from dist_runtime import kernels  # registers every family module

        self._kernels = kernels.registered()

    def supports(self, op: OpPayload, input_specs: Sequence[TensorSpec]) -> bool:
        return type(op) in self._kernels

    def bind(self, node: Node) -> BoundKernel:
        kernel, op = self._kernels[type(node.op)], node.op
        return lambda inputs, ctx: kernel(op, inputs, ctx)

    def execute(self, node: Node, inputs: Sequence[Array], ctx: object) -> tuple:
        return self.bind(node)(inputs, ctx)


register_backend("cpu", CpuBackend)

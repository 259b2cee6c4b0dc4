"""ONNX products: MatMul, Gemm and Einsum."""

from __future__ import annotations

from ...ir import ops
from .node import NodeBuilder
from .registry import converter


@converter("MatMul", targets=("Matmul",))
def convert_matmul(node, opset, inputs):
    b = NodeBuilder(node, opset, inputs)
    b.floats(0, 1)
    b.emit(ops.Matmul(transpose_b=False), [b.name(0), b.name(1)], b.out(0))
    return b.done()


@converter("Gemm", targets=("Matmul",))
def convert_gemm(node, opset, inputs):
    """Y = alpha * A' @ B' + beta * C: Transpose (transA), Matmul (transB), Mul, Add."""
    b = NodeBuilder(node, opset, inputs, ("alpha", "beta", "transA", "transB", "broadcast"))
    dtype = b.floats(0, 1, 2)
    if b.rank(0) != 2 or b.rank(1) != 2:
        raise b.fail("A and B must be matrices")
    alpha, beta = float(b.attr("alpha", 1.0)), float(b.attr("beta", 1.0))
    a = b.name(0)
    if b.attr("transA", 0):
        a = b.emit(ops.Transpose(dim0=0, dim1=1), [a])
    use_c = b.has(2) and beta != 0.0
    last = alpha == 1.0 and not use_c
    y = b.emit(ops.Matmul(transpose_b=bool(b.attr("transB", 0))), [a, b.name(1)], b.out(0) if last else None)
    if alpha != 1.0:
        y = b.emit(ops.Mul(), [y, b.scalar("alpha", alpha, dtype)], None if use_c else b.out(0))
    if use_c:
        c = b.name(2)
        if beta != 1.0:
            c = b.emit(ops.Mul(), [c, b.scalar("beta", beta, dtype)])
        b.emit(ops.Add(), [y, c], b.out(0))
    return b.done()


@converter("Einsum", targets=("Permute", "Matmul", "Reshape"))
def convert_einsum(node, opset, inputs):
    """The einsum forms that are one of our ops: a permutation (Permute), an identity (Reshape),
    and batched matrix or vector products (Matmul)."""
    b = NodeBuilder(node, opset, inputs, ("equation",))
    b.floats(*range(len(inputs)))
    eq = str(b.attr("equation", "")).replace(" ", "")
    if "..." in eq:
        raise b.fail(f"equation {eq!r}: equations with an ellipsis are not mapped")
    if "->" in eq:
        lhs, out = eq.split("->")
    else:  # implicit output: the indices that appear once, in alphabetical order
        lhs = eq
        letters = lhs.replace(",", "")
        out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    terms = lhs.split(",")
    if len(terms) != len(inputs) or any(len(set(t)) != len(t) for t in terms + [out]):
        raise b.fail(f"equation {eq!r}: repeated indices (diagonals) are not mapped")
    if len(terms) == 1:
        (t,) = terms
        if sorted(t) != sorted(out):
            raise b.fail(f"equation {eq!r} sums over an index: we have no reduction op")
        if t == out:
            b.emit(ops.Reshape(shape=(0,) * len(t)), [b.name(0)], b.out(0))
        else:
            b.emit(ops.Permute(perm=tuple(t.index(c) for c in out)), [b.name(0)], b.out(0))
        return b.done()
    if len(terms) == 2:
        a, c = terms
        shared = [x for x in a if x in c and x not in out]
        if len(shared) == 1:
            s = shared[0]
            batch_a, batch_c = a[:-2], c[:-2]
            if len(a) == 1 and len(c) == 1 and out == "":
                b.emit(ops.Matmul(transpose_b=False), [b.name(0), b.name(1)], b.out(0))
                return b.done()
            if len(a) >= 2 and len(c) >= 2 and batch_a == batch_c and a[-1] == s and s not in batch_a:
                m = a[-2]
                if c[-2] == s and out == batch_a + m + c[-1]:
                    b.emit(ops.Matmul(transpose_b=False), [b.name(0), b.name(1)], b.out(0))
                    return b.done()
                if c[-1] == s and out == batch_a + m + c[-2]:
                    b.emit(ops.Matmul(transpose_b=True), [b.name(0), b.name(1)], b.out(0))
                    return b.done()
    raise b.fail(f"equation {eq!r} is not a permutation or a (batched) matrix product")

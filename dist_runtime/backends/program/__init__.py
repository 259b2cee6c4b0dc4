"""A run of a pass's steps as one compiled call: the executor's program.

A 125M Llama's f32 decode step is ~147 steps.  Called one by one from Python, the ~2.4 ms of a
14 ms step between its products is Python -- the executor's loop, each kernel's checks and
allocations, the attention chain's bookkeeping -- whose code and data come back cold after every
product streams its weight through the caches.  The program runs the longest run of steps it
knows as one call of a loop over fixed instructions that calls the very compiled functions those
steps call, in the same order: the same bits.

- :mod:`.instructions`: the instruction set, each opcode's fields by name, in one place;
- :mod:`.builder`: from the executor's steps to instructions, value slots and the weight table
  (every product through the product table, :mod:`..compiled.products`);
- :mod:`.vm`: the compiled loop, its threads kept for the whole call;
- :mod:`.runtime`: :class:`Program`, the executor's step, with its fallback to the steps.

Which steps: the numba backend's kernels that say what they compute (:mod:`..step_kinds`: RmsNorm,
FusedSkipNorm, Matmul and shared launches, FusedSwiGlu, FusedNormMatmul), its attention chain
(Rope, Rope, KvCache, Sdpa on the vector cores), Add, and the pass-on steps of chains and shared
launches, every value they make F32 ``[T, width]``.  Their intermediates live in one arena per
call, reused after each value's last read.
"""

from __future__ import annotations

from ...dtypes import DType
from ...errors import KernelError
from ...ir.ops import KvCache
from .builder import SHARED, KV_VIEW, borders, longest_run
from .runtime import Program


def build(steps: list, graph, specs: dict, constants: dict, backends: list, pass_on,
          kv_dtype: DType = DType.F32, limit: int | None = None) -> tuple[int, int, Program] | str:
    """The longest run of steps ``steps[lo:hi]`` a program takes (``hi <= limit``), as ``(lo, hi,
    program)``, or why none (``inspect --plan``).  ``specs``: the values whose rows follow the pass's (inferred
    at T = 3 and 5), at T = 3; ``kv_dtype``: what the KV caches keep rows in (F32, F16 or Q8_0).
    KV caches kept in Q8_0 whose rows are not a multiple of 32 values are refused here, as the
    executor is made, before anything runs (a :class:`KernelError` naming the node and width)."""
    if kv_dtype == DType.Q8_0:
        _check_q8_widths(graph, specs)
    found = longest_run(steps[:limit], graph, specs, constants, backends, pass_on)
    if isinstance(found, str):
        return found
    lo, hi, b = found
    reads, writes = borders(steps, lo, hi, graph, constants)
    for name in (*reads, *writes):
        if b.values.get(name.removesuffix(SHARED), KV_VIEW) == KV_VIEW:
            return f"value {name!r} crosses the program's border but is not F32 rows"
    return lo, hi, Program(steps[lo:hi], b, reads, writes, constants, kv_dtype)


def _check_q8_widths(graph, specs: dict) -> None:
    """Every KvCache's K and V rows a multiple of 32 values: Q8_0's blocks (kernels/attention.py's
    ``KvState`` refuses a write of others; this says so before the first pass)."""
    for node in graph.nodes:
        if not isinstance(node.op, KvCache):
            continue
        for name in node.inputs[:2]:
            spec = specs.get(name)
            width = spec.shape[-1] if spec is not None and spec.shape else -1
            if width > 0 and width % 32:
                raise KernelError(f"KvCache: node {node.id}'s rows are {width} values wide (kv_heads x head_dim), "
                                  f"not a multiple of 32: a KV cache kept in Q8_0 (--kv-dtype q8_0) holds them "
                                  f"in blocks of 32; keep this model's caches in f16 or f32")

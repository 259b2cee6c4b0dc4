"""The compiled program's instructions: one opcode per kind of step, each a row of :data:`WIDTH`
int64 fields whose layout is declared here, once, by name.

The compiled loop (:mod:`.vm`) reads a field as ``c[RMS_OUT]``; the builder (:mod:`.builder`)
writes a row with :func:`encode`, by field name.  A field is a value slot (a row of the arena:
the fields named in :data:`VALUES`), a row of the weight table, an index into the epsilons or the
KV caches, or a plain number.

======== =======================================================================================
opcode   fields
======== =======================================================================================
RMS      x, scale (weight row), eps (index), out
SKIP     x, residual, scale, eps, total, out: ``total = x + residual``, ``out`` its RmsNorm
PRODUCT  x, w, out: one product of a float-tile weight (F32, F16, BF16, Q8_0 with f32 activations)
JOINT    x, count, w0, out0, w1, out1, w2, out2: two or three float-tile products of one ``x``
K_BLOCKS x, count, w0, out0, w1, out1, w2, out2, kind0, kind1, kind2, q8: one to three K-quant
         products of one ``x`` (kinds 4, 5, 6; ``q8``: Q8_K activations)
L_BLOCKS as K_BLOCKS, for legacy block weights (kinds: their format codes; ``q8``: Q8_0 activations)
SILU     gate, up: ``gate = silu(gate) * up`` in place
ADD      a, b, out
ATTENTION q, k, v, cache, q_rot, k_rot, out, heads, kv_heads, head_dim, causal, window,
         rope_head_dim, rope_dim: a layer's Rope of q and k, KvCache append and Sdpa
======== =======================================================================================
"""

from __future__ import annotations

#: Fields of one instruction row: the opcode, then its operands (zero past the last).
WIDTH = 16

RMS, SKIP, PRODUCT, JOINT, SILU, ADD, ATTENTION, K_BLOCKS, L_BLOCKS = range(1, 10)
NAMES = {RMS: "RMS", SKIP: "SKIP", PRODUCT: "PRODUCT", JOINT: "JOINT", SILU: "SILU", ADD: "ADD",
         ATTENTION: "ATTENTION", K_BLOCKS: "K_BLOCKS", L_BLOCKS: "L_BLOCKS"}

#: Each opcode's field names in column order (column 0 is the opcode).
LAYOUTS: dict[int, tuple[str, ...]] = {}
#: Each opcode's fields that are value slots (the arena's rows), for liveness.
VALUES: dict[int, tuple[str, ...]] = {}


def _layout(op: int, fields: str, values: str) -> range:
    LAYOUTS[op] = tuple(fields.split())
    VALUES[op] = tuple(values.split())
    return range(1, len(LAYOUTS[op]) + 1)


RMS_X, RMS_SCALE, RMS_EPS, RMS_OUT = _layout(RMS, "x scale eps out", "x out")
SKIP_X, SKIP_RESIDUAL, SKIP_SCALE, SKIP_EPS, SKIP_TOTAL, SKIP_OUT = _layout(
    SKIP, "x residual scale eps total out", "x residual total out")
PRODUCT_X, PRODUCT_W, PRODUCT_OUT = _layout(PRODUCT, "x w out", "x out")
# JOINT, K_BLOCKS and L_BLOCKS share their first columns: weight j's row and output are at
# MANY_W0 + 2 j and MANY_W0 + 2 j + 1.
MANY_X, MANY_COUNT, MANY_W0, MANY_OUT0, MANY_W1, MANY_OUT1, MANY_W2, MANY_OUT2 = _layout(
    JOINT, "x count w0 out0 w1 out1 w2 out2", "x out0 out1 out2")
(_, _, _, _, _, _, _, _, BLOCKS_KIND0, BLOCKS_KIND1, BLOCKS_KIND2, BLOCKS_Q8) = _layout(
    K_BLOCKS, "x count w0 out0 w1 out1 w2 out2 kind0 kind1 kind2 q8", "x out0 out1 out2")
LAYOUTS[L_BLOCKS], VALUES[L_BLOCKS] = LAYOUTS[K_BLOCKS], VALUES[K_BLOCKS]
SILU_GATE, SILU_UP = _layout(SILU, "gate up", "gate up")
ADD_A, ADD_B, ADD_OUT = _layout(ADD, "a b out", "a b out")
(ATT_Q, ATT_K, ATT_V, ATT_CACHE, ATT_Q_ROT, ATT_K_ROT, ATT_OUT, ATT_HEADS, ATT_KV_HEADS, ATT_HEAD_DIM, ATT_CAUSAL,
 ATT_WINDOW, ATT_ROPE_HEAD_DIM, ATT_ROPE_DIM) = _layout(
    ATTENTION, "q k v cache q_rot k_rot out heads kv_heads head_dim causal window rope_head_dim rope_dim",
    "q k v q_rot k_rot out")


def encode(op: int, **fields: int) -> list[int]:
    """An instruction row: ``op``'s fields by name, in its layout's order (a missing one is 0)."""
    unknown = set(fields) - set(LAYOUTS[op])
    if unknown:
        raise ValueError(f"{NAMES[op]} has no field {sorted(unknown)}; its fields: {LAYOUTS[op]}")
    return [op, *(int(fields.get(name, 0)) for name in LAYOUTS[op])]


def operands(row) -> list[int]:
    """The value slots an instruction reads or writes (a joint one's outputs: its ``count``)."""
    op = row[0]
    names = VALUES[op]
    if op in (JOINT, K_BLOCKS, L_BLOCKS):
        names = ("x", *(f"out{j}" for j in range(row[MANY_COUNT])))
    return [row[1 + LAYOUTS[op].index(name)] for name in names]


def describe(row) -> str:
    """One instruction as ``OPCODE field=value ...`` (for reading a program)."""
    op = int(row[0])
    return " ".join([NAMES[op], *(f"{name}={int(v)}" for name, v in zip(LAYOUTS[op], row[1:]))])

"""The payload machinery every op is declared with: wire types, ``OpPayload``, ``OpSpec`` and ``@op``.

``ops.py`` declares the 66 ops with it; the graph, the codec and the text forms need only this
module, and ``shape_rules.py`` attaches one shape rule to each op's ``OpSpec``.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import typing
from dataclasses import dataclass
from typing import Annotated, Callable, ClassVar

from ..dtypes import DType
from ..errors import GraphValidationError
from .tensor_spec import TensorSpec


# -- wire types ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Wire:
    """How one payload field is laid out in the binary form."""

    name: str  # as documented in docs/format.md
    fmt: str | None  # struct format of a scalar, None for a list
    lo: float | None = None  # inclusive integer range, for checks
    hi: float | None = None


U8 = Annotated[int, Wire("u8", "<B", 0, 2**8 - 1)]
U32 = Annotated[int, Wire("u32", "<I", 0, 2**32 - 1)]
I32 = Annotated[int, Wire("i32", "<i", -(2**31), 2**31 - 1)]
F32 = Annotated[float, Wire("f32", "<f")]
Bool = Annotated[bool, Wire("bool", "<B", 0, 1)]  # u8, 0 or 1
DTypeTag = Annotated[DType, Wire("dtype", "<B")]  # u8 dtype tag
Ints = Annotated[tuple[int, ...], Wire("i64[]", None, -(2**63), 2**63 - 1)]  # u32 n + i64 × n


def round_f32(x: float) -> float:
    """``x`` rounded to f32 (+-inf beyond its range), as a payload holds it: a payload equals
    itself after a binary round trip, and the TOML and text forms print what it holds."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


# -- payload base class ------------------------------------------------------------------------
class OpPayload:
    """Base of all op payloads.  Subclasses are frozen dataclasses made by :func:`op`."""

    spec: ClassVar[OpSpec]

    def __post_init__(self) -> None:
        for f in self.spec.fields:
            value = getattr(self, f.name)
            object.__setattr__(self, f.name, _check_field(self, f, value))

    def payload(self) -> dict[str, object]:
        """The payload as a plain dict (field name -> value), in wire order."""
        return {f.name: getattr(self, f.name) for f in self.spec.fields}


def _check_field(payload: OpPayload, f: Field, value: object) -> object:
    where = f"{type(payload).__name__}.{f.name}"
    wire = f.wire
    if wire.name == "f32":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GraphValidationError(f"{where} must be a number, got {value!r}")
        if math.isnan(value):  # meaningless in every payload, and NaN bits do not round-trip
            raise GraphValidationError(f"{where} must not be NaN")
        return round_f32(float(value))
    if wire.name == "dtype":
        try:
            return DType(value)
        except ValueError:
            raise GraphValidationError(f"{where}: {value!r} is not a dtype tag") from None
    if wire.name == "bool":
        if value not in (0, 1):  # True/False, or 0/1 from a decoder
            raise GraphValidationError(f"{where} must be a bool, got {value!r}")
        return bool(value)
    items = tuple(value) if wire.fmt is None and isinstance(value, (list, tuple)) else (value,)
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int) or not wire.lo <= v <= wire.hi:
            raise GraphValidationError(
                f"{where} must be {'integers' if wire.fmt is None else 'an integer'} in "
                f"[{wire.lo}, {wire.hi}] ({wire.name}), got {value!r}"
            )
    return items if wire.fmt is None else value


# -- the table ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    name: str
    wire: Wire
    default: object


#: How an op treats the rows (axis 0) of a pass that carries several sessions' rows, concatenated
#: (docs/ops.md, "Rows of several sessions"; the executor's batched pass):
INDEPENDENT = "independent"  # each row computed alone: one call over every session's rows
POSITIONAL = "positional"  # each row by its own position: one call per session, with its ``pos``
PER_SESSION = "per-session"  # reads a session's state (KV cache, sampler) or its other rows: one call per session
MIXED = "mixed"  # rows combine in ways sessions' segments cannot separate: one session per pass
ALONG_DIM = "along dim"  # independent when it acts along the last dim (``dim`` = -1), else mixed
ROW_KINDS = (INDEPENDENT, POSITIONAL, PER_SESSION, MIXED)

#: ``rule(payload, input specs) -> output specs``; each rule names its payload class (shape_rules.py).
ShapeRule = Callable[..., list[TensorSpec]]


@dataclass(frozen=True)
class OpSpec:
    """Everything the runtime knows about one op, derived from its declaration."""

    tag: int
    name: str
    cls: type
    fields: tuple[Field, ...]
    inputs: tuple[int, int]  # (min, max) number of input tensors
    outputs: int | str  # a fixed count, or the payload field that gives it (Split, Chunk)
    shape: ShapeRule | None  # entered once by shape_rules.rule
    doc: str
    # Input positions that take a matmul-style weight: it may stay in its stored (possibly
    # block-quantized) form and reach the kernel as is.  Weights in any other position are
    # widened to f32 once when an executor prepares the graph.
    weight_inputs: tuple[int, ...] = ()
    rows: str = MIXED  # one of ROW_KINDS, or ALONG_DIM

    def row_kind(self, payload: OpPayload) -> str:
        """How ``payload``'s rows behave in a pass of several sessions (one of ROW_KINDS)."""
        if self.rows == ALONG_DIM:
            return INDEPENDENT if getattr(payload, "dim") == -1 else MIXED
        return self.rows

    def num_outputs(self, payload: OpPayload) -> int:
        if isinstance(self.outputs, int):
            return self.outputs
        value = getattr(payload, self.outputs)
        return len(value) if isinstance(value, tuple) else int(value)


OPS_BY_TAG: dict[int, OpSpec] = {}
OPS_BY_NAME: dict[str, OpSpec] = {}


def op(tag: int, *, inputs: tuple[int, int], doc: str, outputs: int | str = 1,
       weight_inputs: tuple[int, ...] = (), rows: str = MIXED):
    """Declare a payload class and enter it in the op table under ``tag``."""

    def register(cls: type) -> type:
        cls = dataclass(frozen=True)(cls)
        hints = typing.get_type_hints(cls, include_extras=True)
        fields = []
        for f in dataclasses.fields(cls):
            (wire,) = [m for m in hints[f.name].__metadata__ if isinstance(m, Wire)]
            fields.append(Field(f.name, wire, f.default))
        name = cls.__name__
        if tag in OPS_BY_TAG or name in OPS_BY_NAME or not 0 <= tag < 2**16:
            raise AssertionError(f"op {name} reuses tag {tag} or a name, or the tag is not a u16")
        if rows not in (*ROW_KINDS, ALONG_DIM) or (rows == ALONG_DIM and "dim" not in {f.name for f in fields}):
            raise AssertionError(f"op {name}: rows must be one of {ROW_KINDS} or {ALONG_DIM!r} (with a dim field)")
        spec = OpSpec(tag, name, cls, tuple(fields), inputs, outputs, None, doc, weight_inputs, rows)
        cls.spec = spec
        OPS_BY_TAG[tag] = OPS_BY_NAME[name] = spec
        return cls

    return register

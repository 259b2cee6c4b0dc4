"""The canonical binary form of a graph (the ``~~~graph`` section), exactly as the seed lays it out.

Little-endian throughout; counts are u32; a string is a u32 byte length then UTF-8; a node is
``u32 id, u16 op_tag, op_payload, u32 n + string[n] inputs, u32 n + string[n] outputs,
u8 has_backend_hint [, u8 backend_hint]``; a tensor_spec is ``u32 rank, i64[rank], u8 dtype_tag,
u8 has_offset [, u64 offset, u64 size]``.  Op payload fields follow the op's declaration in
``ops.py`` (docs/format.md lists every op's layout).  Weights and ``Node.attrs`` are not carried.

Decoding trusts nothing: every count and length is checked against the bytes that remain before
anything is allocated, and every failure is a :class:`ModelFormatError` naming the byte offset.
"""

from __future__ import annotations

import struct

from ..dtypes import DType
from ..errors import GraphValidationError, ModelFormatError
from .graph import Graph, Node, TensorSpec
from .payload import OPS_BY_TAG, Field, OpPayload

#: A tensor's rank above this is rejected as corrupt (numpy's own limit is 64).
MAX_RANK = 64
#: Bytes that one encoded node, input spec or output name occupies at the least; used to reject
#: a count that cannot fit in the remaining bytes before building a list of that length.
MIN_NODE_BYTES = 4 + 2 + 4 + 4 + 1
MIN_SPEC_BYTES = 4 + 1 + 1
MIN_STRING_BYTES = 4


class _Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def put(self, fmt: str, *values) -> None:
        try:
            self.parts.append(struct.pack(fmt, *values))
        except struct.error as e:
            raise GraphValidationError(f"cannot encode {values!r} as {fmt!r}: {e}") from None

    def string(self, s: str) -> None:
        data = s.encode("utf-8")
        self.put("<I", len(data))
        self.parts.append(data)

    def strings(self, items: list[str]) -> None:
        self.put("<I", len(items))
        for s in items:
            self.string(s)

    def spec(self, spec: TensorSpec) -> None:
        self.put("<I", len(spec.shape))
        self.put(f"<{len(spec.shape)}q", *spec.shape)
        self.put("<B", int(spec.dtype))
        if spec.offset is None:
            self.put("<B", 0)
        else:
            self.put("<BQQ", 1, spec.offset, spec.size)

    def field(self, f: Field, value) -> None:
        if f.wire.fmt is None:  # a list: u32 count then i64 items
            self.put("<I", len(value))
            self.put(f"<{len(value)}q", *value)
        else:
            self.put(f.wire.fmt, int(value) if f.wire.name != "f32" else value)


def encode_graph(graph: Graph) -> bytes:
    """The canonical bytes of ``graph`` (weights and node attrs are not part of them)."""
    w = _Writer()
    w.put("<I", len(graph.nodes))
    for node in graph.nodes:
        spec = type(node.op).spec
        w.put("<IH", node.id, spec.tag)
        for f in spec.fields:
            w.field(f, getattr(node.op, f.name))
        w.strings(node.inputs)
        w.strings(node.outputs)
        if node.backend_hint is None:
            w.put("<B", 0)
        else:
            w.put("<BB", 1, node.backend_hint)
    w.put("<I", len(graph.inputs))
    for spec in graph.inputs:
        w.spec(spec)
    w.strings(graph.outputs)
    return b"".join(w.parts)


class Reader:
    """A cursor over untrusted bytes: every read is bounds-checked and names its offset."""

    def __init__(self, data: bytes | memoryview, what: str = "graph section") -> None:
        self.data = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        self.pos = 0
        self.what = what

    def fail(self, message: str, at: int | None = None) -> ModelFormatError:
        return ModelFormatError(f"{self.what}, byte {self.pos if at is None else at}: {message}")

    def take(self, n: int, what: str) -> bytes:
        if n > len(self.data) - self.pos:
            raise self.fail(
                f"{what} needs {n} bytes but only {len(self.data) - self.pos} remain (truncated?)"
            )
        chunk = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return chunk

    def get(self, fmt: str, what: str):
        values = struct.unpack(fmt, self.take(struct.calcsize(fmt), what))
        return values[0] if len(values) == 1 else values

    def count(self, what: str, min_item_bytes: int) -> int:
        """A u32 count, checked against the bytes that remain before any list is built."""
        at = self.pos
        n = self.get("<I", f"{what} count")
        if n * min_item_bytes > len(self.data) - self.pos:
            raise self.fail(
                f"{what} count is {n}, but at {min_item_bytes} bytes each that needs "
                f"{n * min_item_bytes} bytes and only {len(self.data) - self.pos} remain",
                at,
            )
        return n

    def string(self, what: str) -> str:
        at = self.pos
        n = self.get("<I", f"{what} length")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})", at) from None

    def strings(self, what: str) -> list[str]:
        n = self.count(what, MIN_STRING_BYTES)
        return [self.string(f"{what}[{i}]") for i in range(n)]

    def flag(self, what: str) -> bool:
        at = self.pos
        b = self.get("<B", what)
        if b > 1:
            raise self.fail(f"{what} must be 0 or 1, got {b}", at)
        return bool(b)

    def spec(self, what: str) -> TensorSpec:
        at = self.pos
        rank = self.get("<I", f"{what} rank")
        if rank > MAX_RANK:
            raise self.fail(f"{what} rank {rank} exceeds the limit of {MAX_RANK}", at)
        shape = self.get(f"<{rank}q", f"{what} shape") if rank else ()
        shape = (shape,) if isinstance(shape, int) else shape
        for d in shape:
            if d < -1:
                raise self.fail(f"{what} shape {list(shape)} has a dim below -1", at)
        dtype = DType.from_tag(self.get("<B", f"{what} dtype"), f" in {self.what} at {what}")
        if self.flag(f"{what} has_offset"):
            offset, size = self.get("<QQ", f"{what} offset and size")
            return TensorSpec(shape, dtype, offset, size)
        return TensorSpec(shape, dtype)

    def payload(self, cls: type, where: str) -> OpPayload:
        at = self.pos
        values = {}
        for f in cls.spec.fields:
            what = f"{where} {cls.__name__}.{f.name}"
            if f.wire.fmt is None:
                n = self.count(what, 8)
                values[f.name] = self.get(f"<{n}q", what) if n else ()
                if isinstance(values[f.name], int):
                    values[f.name] = (values[f.name],)
            elif f.wire.name == "dtype":
                values[f.name] = DType.from_tag(self.get(f.wire.fmt, what), f" in {what}")
            else:
                values[f.name] = self.get(f.wire.fmt, what)
        try:
            return cls(**values)
        except GraphValidationError as e:  # e.g. a bool field holding 7
            raise self.fail(f"{where}: invalid payload: {e}", at) from None

    def node(self, index: int) -> Node:
        where = f"node[{index}]"
        node_id = self.get("<I", f"{where} id")
        at = self.pos
        tag = self.get("<H", f"{where} op_tag")
        spec = OPS_BY_TAG.get(tag)
        if spec is None:
            raise self.fail(f"{where} (id {node_id}) has unknown op tag {tag}", at)
        op = self.payload(spec.cls, where)
        inputs = self.strings(f"{where} inputs")
        outputs = self.strings(f"{where} outputs")
        hint = self.get("<B", f"{where} backend_hint") if self.flag(f"{where} has_backend_hint") else None
        return Node(node_id, op, inputs, outputs, {}, hint)


def decode_graph(data: bytes | memoryview, what: str = "graph section") -> Graph:
    """Parse canonical graph bytes.  Raises ``ModelFormatError`` for anything malformed,
    including trailing bytes after the graph."""
    r = Reader(data, what)
    nodes = [r.node(i) for i in range(r.count("node", MIN_NODE_BYTES))]
    inputs = [r.spec(f"input[{i}]") for i in range(r.count("input", MIN_SPEC_BYTES))]
    outputs = r.strings("outputs")
    if r.pos != len(r.data):
        raise r.fail(f"{len(r.data) - r.pos} trailing bytes after the graph")
    return Graph(nodes, inputs, outputs, {})

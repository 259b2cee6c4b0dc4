"""The ``.model`` container: metadata, a tensors index, an optional graph and the raw weights.

Layout (docs/format.md is the full specification)::

    ~~~model 1\\n                       magic line, format version 1
    ~~~metadata.toml <size>\\n          header line of a section: name and data size in bytes
    <zero padding to a multiple of 64>
    <size bytes of data>
    ~~~tensors.toml <size>\\n ...       next header immediately after the previous data
    ~~~graph <size>\\n ...              (or ~~~graph.toml)
    ~~~weights <size>\\n ...

:func:`save_model` writes a file atomically; :func:`load_model` maps it read-only and returns a
:class:`Model` whose weights are zero-copy numpy views into the mapping.  Loading trusts nothing:
every header, size, TOML document, index entry and graph byte is checked before it is used, and
every problem with the bytes is a :class:`ModelFormatError` naming the section, the byte offset
and, where there is one, the tensor.
"""

from __future__ import annotations

import difflib
import mmap
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .dtypes import DType
from .scheduling_defaults import KV_DTYPE_NAMES
from .errors import DistRuntimeError, GraphValidationError, ModelFormatError
from .ir.codec import decode_graph, encode_graph
from .ir.graph import Graph, TensorSpec
from .ir.toml_form import graph_from_toml
from .safe_toml import MAX_TOML_BYTES, MAX_TOML_DEPTH, parse_toml  # noqa: F401  (limits are API)
from .tensor import Array, Deferred, QuantizedArray

__all__ = [
    "MAGIC",
    "ALIGN",
    "Model",
    "SectionInfo",
    "UnknownTensorError",
    "encode_container",
    "encode_index",
    "load_model",
    "read_sections",
    "save_model",
]

#: The first line of every .model file: the format name and version 1.
MAGIC = b"~~~model 1\n"
_MAGIC_PREFIX = b"~~~model "
#: Every section's data, and every tensor in the weights section, starts at a multiple of this.
ALIGN = 64
#: A header line (``~~~name size\n``), newline included, is at most this many bytes.
MAX_HEADER_BYTES = 256
#: A tensor's rank is at most this (numpy's own limit).
MAX_RANK = 64
#: A tensor holds at most this many elements, counting only its non-zero dimensions.
MAX_ELEMENTS = 2**48
_MAX_DIM = 2**63 - 1

_HEADER_RE = re.compile(rb"~~~([A-Za-z0-9._-]+) ([0-9]{1,20})\n")
_SECTION_RANK = {"metadata.toml": 0, "tensors.toml": 1, "graph": 2, "graph.toml": 2, "weights": 3, "end": 4}
#: The last section of every file, with no data: a file cut anywhere lacks it, so truncation is
#: always detected (even a cut right after a section that would otherwise end a valid file).
END = "end"
_INDEX_KEYS = ("name", "shape", "dtype", "offset", "size")
#: Reserved metadata keys and the type each must have.
_RESERVED_METADATA = {"name": str, "architecture": str, "max_memory": int, "created_by": str, "kv_dtype": str,
                      "chat_template": str}

_PROGRESS_THRESHOLD = 64 * 2**20
_WRITE_CHUNK = 16 * 2**20


class UnknownTensorError(DistRuntimeError, KeyError):
    """A tensor name that the model's index does not contain (also a ``KeyError``)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class SectionInfo:
    """Where one section lies in the file (all offsets absolute)."""

    name: str
    header_offset: int  # first byte of the ``~~~name size\n`` line
    offset: int  # first data byte (a multiple of ALIGN)
    size: int  # data bytes

    @property
    def end(self) -> int:
        return self.offset + self.size


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# -- container: headers ------------------------------------------------------------------------
def read_sections(buf: bytes | mmap.mmap, what: str = "file") -> list[SectionInfo]:
    """Parse the magic line and every section header of a container held in ``buf``.

    Checks header syntax, sizes against the bytes that remain, zero padding, section names, order,
    duplicates, required sections and trailing bytes.  Reads no section data except padding.
    """
    length = len(buf)
    if length < len(MAGIC) or buf[: len(MAGIC)] != MAGIC:
        first = bytes(buf[: min(length, 32)])
        if first.startswith(_MAGIC_PREFIX):
            line = first.split(b"\n", 1)[0]
            raise ModelFormatError(
                f"{what}, byte 0: unsupported .model format version: the magic line is {line!r}, "
                f"this reader reads only {MAGIC!r}"
            )
        raise ModelFormatError(
            f"{what}, byte 0: not a .model file: expected the magic line {MAGIC!r}, found "
            f"{first[: len(MAGIC)]!r}" + (f" ({length} bytes in all)" if length < len(MAGIC) else "")
        )
    sections: list[SectionInfo] = []
    pos = len(MAGIC)
    while pos < length:
        limit = min(length, pos + MAX_HEADER_BYTES)
        nl = buf.find(b"\n", pos, limit)
        if nl < 0:
            if limit == length:
                raise ModelFormatError(
                    f"{what}, byte {pos}: the last {length - pos} bytes are not a section header "
                    f"line (no newline): trailing bytes, or a truncated header? "
                    f"{bytes(buf[pos:limit])[:64]!r}"
                )
            raise ModelFormatError(
                f"{what}, byte {pos}: section header line is longer than {MAX_HEADER_BYTES} bytes"
            )
        line = bytes(buf[pos : nl + 1])
        m = _HEADER_RE.fullmatch(line)
        if m is None:
            raise ModelFormatError(
                f"{what}, byte {pos}: malformed section header {line!r}; expected "
                "'~~~<name> <size>\\n' with a name of [A-Za-z0-9._-] and a size of 1 to 20 "
                "decimal digits"
            )
        name = m.group(1).decode("ascii")
        size = int(m.group(2))
        data_start = _align(nl + 1)
        if data_start > length:
            raise ModelFormatError(
                f"{what}, byte {nl + 1}: section {name!r}: the padding to byte {data_start} runs "
                f"past the end of the file ({length} bytes; truncated?)"
            )
        if size > length - data_start:
            raise ModelFormatError(
                f"{what}, byte {pos}: section {name!r} claims {size} bytes of data at byte "
                f"{data_start}, but only {length - data_start} bytes remain (truncated?)"
            )
        pad = bytes(buf[nl + 1 : data_start])
        if pad.count(0) != len(pad):
            bad = nl + 1 + next(i for i, b in enumerate(pad) if b)
            raise ModelFormatError(
                f"{what}, byte {bad}: section {name!r}: padding before the data must be zero bytes"
            )
        sections.append(SectionInfo(name, pos, data_start, size))
        pos = data_start + size
    _check_layout(sections, what)
    return sections


def _check_layout(sections: list[SectionInfo], what: str) -> None:
    seen: dict[str, SectionInfo] = {}
    last_rank, last_name = -1, None
    for s in sections:
        where = f"{what}, byte {s.header_offset}: section {s.name!r}"
        if s.name in seen:
            raise ModelFormatError(
                f"{where}: duplicate section (first at byte {seen[s.name].header_offset})"
            )
        seen[s.name] = s
        if s.name.startswith("x-"):
            continue  # an extension: skipped wherever it appears
        rank = _SECTION_RANK.get(s.name)
        if rank is None:
            known = ", ".join(_SECTION_RANK)
            raise ModelFormatError(
                f"{where}: unknown section name; known sections are {known}, and extensions "
                "start with 'x-'"
            )
        if rank == last_rank:
            raise ModelFormatError(f"{where}: a file has either 'graph' or 'graph.toml', not both")
        if rank < last_rank:
            raise ModelFormatError(
                f"{where}: out of order after {last_name!r}; sections go in the order "
                "metadata.toml, tensors.toml, graph or graph.toml, weights"
            )
        last_rank, last_name = rank, s.name
    if not sections or sections[-1].name != END:
        raise ModelFormatError(
            f"{what}: the file does not finish with the '{END}' section (truncated, or written "
            "by an incomplete writer?)"
        )
    if sections[-1].size:
        raise ModelFormatError(f"{what}: the '{END}' section must be empty, it claims {sections[-1].size} bytes")
    if "metadata.toml" not in seen:
        raise ModelFormatError(f"{what}: the required section 'metadata.toml' is missing")
    if ("tensors.toml" in seen) != ("weights" in seen):
        have, missing = ("tensors.toml", "weights") if "tensors.toml" in seen else ("weights", "tensors.toml")
        raise ModelFormatError(
            f"{what}: section {have!r} is present but {missing!r} is missing; the tensors "
            "index and the weights come together"
        )


def encode_container(sections: Iterable[tuple[str, bytes]], *, end: bool = True) -> bytes:
    """The bytes of a container with the given ``(name, data)`` sections, in the order given.

    Writes the magic line, each header and the zero padding; checks only the header syntax (the
    caller chooses names and order, so tests can build invalid files with it).
    """
    out = bytearray(MAGIC)
    for name, data in [*sections, *([(END, b"")] if end else [])]:
        out += _header(name, len(data), len(out))
        out += data
    return bytes(out)


def _header(name: str, size: int, at: int) -> bytes:
    line = f"~~~{name} {size}\n".encode("ascii")
    if _HEADER_RE.fullmatch(line) is None or len(line) > MAX_HEADER_BYTES:
        raise ValueError(f"invalid section name {name!r} or size {size}")
    return line + bytes(_align(at + len(line)) - at - len(line))


# -- TOML sections -----------------------------------------------------------------------------
def _check_metadata(meta: Mapping, fail) -> None:
    for key, typ in _RESERVED_METADATA.items():
        if key not in meta:
            continue
        value = meta[key]
        if type(value) is not typ:  # bool is not int
            fail(f"metadata key {key!r} must be a {typ.__name__}, got {value!r}")
        if key == "max_memory" and value < 0:
            fail(f"metadata key 'max_memory' must be >= 0, got {value}")
        if key == "kv_dtype" and value not in KV_DTYPE_NAMES:
            fail(f"metadata key 'kv_dtype' must be one of {', '.join(KV_DTYPE_NAMES)}, got {value!r}")


# -- the tensors index -------------------------------------------------------------------------
def _toml_string(s: str) -> str:
    out = ['"']
    for ch in s:
        c = ord(ch)
        if ch == '"' or ch == "\\":
            out.append("\\" + ch)
        elif c < 0x20 or c == 0x7F:
            out.append(f"\\u{c:04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def encode_index(index: Mapping[str, TensorSpec]) -> str:
    """The ``tensors.toml`` text for ``index`` (name -> spec with offset and size), in order.

    Writes what it is given without checking it (tests use it to build invalid indexes)."""
    lines = []
    for name, spec in index.items():
        lines += [
            "[[tensor]]",
            f"name = {_toml_string(name)}",
            f"shape = [{', '.join(str(int(d)) for d in spec.shape)}]",
            f'dtype = "{spec.dtype.name.lower()}"',
            f"offset = {spec.offset}",
            f"size = {spec.size}",
            "",
        ]
    return "\n".join(lines)


def _parse_index(doc: dict, where: str, weights_size: int) -> dict[str, TensorSpec]:
    def fail(msg: str) -> None:
        raise ModelFormatError(f"{where}: {msg}")

    extra = [k for k in doc if k != "tensor"]
    if extra:
        fail(f"unknown top-level key(s) {extra}; the index holds only [[tensor]] tables")
    entries = doc.get("tensor", [])
    if not isinstance(entries, list):
        fail("'tensor' must be an array of tables ([[tensor]])")
    index: dict[str, TensorSpec] = {}
    for i, e in enumerate(entries):
        at = f"tensor[{i}]"
        if not isinstance(e, dict):
            fail(f"{at} is not a table")
        name = e.get("name")
        if type(name) is not str or not name:
            fail(f"{at}: 'name' must be a non-empty string, got {name!r}")
        at = f"tensor[{i}] {name!r}"
        missing = [k for k in _INDEX_KEYS if k not in e]
        unknown = [k for k in e if k not in _INDEX_KEYS]
        if missing or unknown:
            fail(f"{at}: missing key(s) {missing}, unknown key(s) {unknown}")
        if name in index:
            fail(f"{at}: duplicate tensor name")
        shape = e["shape"]
        if not isinstance(shape, list):
            fail(f"{at}: 'shape' must be an array of integers, got {shape!r}")
        if len(shape) > MAX_RANK:
            fail(f"{at}: rank {len(shape)} exceeds the limit of {MAX_RANK}")
        for d in shape:
            if type(d) is not int or not 0 <= d <= _MAX_DIM:
                fail(f"{at}: shape {shape} must hold integers in [0, 2^63-1], found {d!r}")
        dtype_name = e["dtype"]
        if type(dtype_name) is not str or dtype_name != dtype_name.lower():
            fail(f"{at}: 'dtype' must be a lowercase type name like \"f32\", got {dtype_name!r}")
        dtype = DType.from_name(dtype_name, f" in {where} at {at}")
        offset, size = e["offset"], e["size"]
        for key, value in (("offset", offset), ("size", size)):
            if type(value) is not int or value < 0:
                fail(f"{at}: {key!r} must be a non-negative integer, got {value!r}")
        count = 1
        for d in shape:
            count *= d or 1
        if count > MAX_ELEMENTS:
            fail(f"{at}: shape {shape} has {count} elements (zero dims ignored), above {MAX_ELEMENTS}")
        try:
            nbytes = dtype.nbytes(shape)
        except ModelFormatError as err:
            fail(f"{at}: {err}")
        if size != nbytes:
            fail(f"{at}: size is {size} bytes, but {dtype_name}{shape} takes {nbytes} bytes")
        if offset % ALIGN:
            fail(f"{at}: offset {offset} is not a multiple of {ALIGN}")
        if offset + size > weights_size:
            fail(
                f"{at}: bytes [{offset}, {offset + size}) lie outside the weights section "
                f"({weights_size} bytes)"
            )
        index[name] = TensorSpec(tuple(shape), dtype, offset, size)
    spans = sorted((s.offset, s.offset + s.size, n) for n, s in index.items() if s.size)
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            fail(f"tensors {an!r} [{a0}, {a1}) and {bn!r} [{b0}, {b1}) overlap in the weights section")
    return index


# -- Model -------------------------------------------------------------------------------------
class Model:
    """A loaded ``.model`` file.  Use :func:`load_model` (or :func:`save_model`) to get one.

    Attributes: ``path``, ``metadata`` (dict), ``graph`` (Graph or None; its ``weights`` are the
    index), ``graph_format`` ("binary", "toml" or None), ``index`` (name -> TensorSpec with
    offset/size relative to the weights section), ``weights`` (name -> read-only array view into
    the mapping, the materialised subset), ``warnings`` (list of str from validation) and
    ``sections`` (list of SectionInfo).
    """

    def __init__(self) -> None:  # filled in by _open
        self.path: Path = Path()
        self.metadata: dict = {}
        self.graph: Graph | None = None
        self.graph_format: str | None = None
        self.index: dict[str, TensorSpec] = {}
        self.weights: dict[str, Array] = {}
        self.warnings: list[str] = []
        self.sections: list[SectionInfo] = []
        self._mm: mmap.mmap | None = None
        self._weights_offset: int | None = None

    # -- public API ------------------------------------------------------------------------------
    def tensor(self, name: str) -> Array:
        """The tensor ``name`` as a zero-copy view, mapping it now if it was not loaded yet."""
        if name in self.weights:
            return self.weights[name]
        self._check_names([name])
        if self._mm is None:
            raise DistRuntimeError(f"{self.path}: the model is closed; cannot map tensor {name!r}")
        arr = self._view(name)
        self.weights[name] = arr
        return arr

    def byte_range(self, name: str) -> tuple[int, int]:
        """``(absolute file offset, size in bytes)`` of tensor ``name``'s data."""
        self._check_names([name])
        spec = self.index[name]
        return self._weights_offset + spec.offset, spec.size

    def release(self, names: Iterable[str]) -> int:
        """Tell the kernel this process no longer needs the pages of tensors ``names`` (held as
        copies elsewhere: the executor's huge-page buffer), so they leave its resident memory;
        returns the bytes advised.  Safe whatever still views them: a page read again is read
        from the file again.  Drops the names from :attr:`weights`."""
        if self._mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return 0
        page, freed = mmap.PAGESIZE, 0
        for name in names:
            start, size = self.byte_range(name)
            lo, hi = -(-start // page) * page, (start + size) // page * page  # whole pages only
            if hi > lo:
                self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                freed += hi - lo
            self.weights.pop(name, None)
        return freed

    def close(self) -> None:
        """Drop this model's views and unmap the file.

        Arrays the caller still holds keep the mapping alive; it is unmapped once the last of them
        is gone.  Idempotent.
        """
        self.weights = {}
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views still exported: the mapping lives until they are garbage

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        g = f"{len(self.graph.nodes)} nodes" if self.graph is not None else "no graph"
        return (
            f"<Model {str(self.path)!r}: {g}, {len(self.index)} tensors "
            f"({len(self.weights)} mapped){'' if self._mm is not None else ', closed'}>"
        )

    # -- internals -------------------------------------------------------------------------------
    def _check_names(self, names: Iterable[str]) -> None:
        for name in names:
            if name in self.index:
                continue
            near = difflib.get_close_matches(str(name), list(self.index), n=5, cutoff=0.6)
            if near:
                hint = f"nearby names: {', '.join(map(repr, near))}"
            elif self.index:
                some = list(self.index)[:5]
                hint = f"the index holds {len(self.index)} tensors, e.g. {', '.join(map(repr, some))}"
            else:
                hint = "the file has no tensors"
            raise UnknownTensorError(f"{self.path}: no tensor named {name!r}; {hint}")

    def _view(self, name: str) -> Array:
        spec = self.index[name]
        start = self._weights_offset + spec.offset
        dtype = spec.dtype
        if dtype.is_quantized:
            row = spec.shape[-1] // dtype.block_size * dtype.block_bytes
            data = np.frombuffer(self._mm, np.uint8, count=spec.size, offset=start)
            return QuantizedArray(data.reshape(*spec.shape[:-1], row), dtype, spec.shape)
        count = spec.size // dtype.block_bytes
        arr = np.frombuffer(self._mm, dtype.numpy, count=count, offset=start).reshape(spec.shape)
        if dtype is DType.BOOL and count and arr.view(np.uint8).max() > 1:
            raise ModelFormatError(
                f"{self.path}, section 'weights', byte {start}: tensor {name!r} is bool but holds "
                "a byte other than 0 or 1"
            )
        return arr


def load_model(
    path: str | os.PathLike, *, tensors: Iterable[str] | None = None, validate: bool = True
) -> Model:
    """Map a ``.model`` file read-only and check it.

    ``tensors``: names of the weights to materialise as views (default: all); the index of every
    tensor is read regardless, and :meth:`Model.tensor` maps more later.  ``validate``: run graph
    validation (``validate_graph``) against ``metadata["max_memory"]``; the container itself is
    always checked.  Raises ``ModelFormatError`` for malformed bytes, ``GraphValidationError`` for
    an invalid graph and ``UnknownTensorError`` for a requested name not in the index.
    """
    if isinstance(tensors, (str, bytes)):
        raise TypeError("tensors= takes an iterable of names, not a single string")
    model = Model()
    model.path = Path(path)
    what = str(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < len(MAGIC):
            head = f.read(len(MAGIC))
            raise ModelFormatError(
                f"{what}, byte 0: not a .model file: {size} bytes is too short for the magic "
                f"line {MAGIC!r} (found {head!r})"
            )
        model._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        _fill(model, what, tensors, validate)
    except BaseException:
        model.close()
        raise
    return model


def _fill(model: Model, what: str, tensors: Iterable[str] | None, validate: bool) -> None:
    mm = model._mm
    sections = read_sections(mm, what)
    model.sections = sections
    by_name = {s.name: s for s in sections}

    def where(s: SectionInfo) -> str:
        return f"{what}, section {s.name!r} at byte {s.offset}"

    def check_toml_size(s: SectionInfo) -> None:
        if s.size > MAX_TOML_BYTES:  # before reading a byte of it
            raise ModelFormatError(
                f"{where(s)}: {s.size} bytes exceeds the TOML limit of {MAX_TOML_BYTES}"
            )

    def toml_of(s: SectionInfo) -> dict:
        check_toml_size(s)
        return parse_toml(mm[s.offset : s.end], where(s))

    meta_s = by_name["metadata.toml"]
    metadata = toml_of(meta_s)

    def meta_fail(msg: str) -> None:
        raise ModelFormatError(f"{where(meta_s)}: {msg}")

    _check_metadata(metadata, meta_fail)
    model.metadata = metadata

    if "weights" in by_name:
        w = by_name["weights"]
        model._weights_offset = w.offset
        idx_s = by_name["tensors.toml"]
        doc = toml_of(idx_s)
        model.index = _parse_index(doc, where(idx_s), w.size)

    names = list(model.index) if tensors is None else list(dict.fromkeys(tensors))
    model._check_names(names)  # before the graph: a wrong name is the caller's first problem

    graph_s = by_name.get("graph") or by_name.get("graph.toml")
    if graph_s is not None:
        if graph_s.name == "graph.toml":
            check_toml_size(graph_s)
        model.graph = _read_graph(mm[graph_s.offset : graph_s.end], graph_s, where(graph_s), model.index)
        model.graph_format = "binary" if graph_s.name == "graph" else "toml"

    if validate and model.graph is not None:
        model.warnings = _validate(model.graph, metadata.get("max_memory"))

    for name in names:
        model.weights[name] = model._view(name)


def _read_graph(raw: bytes, s: SectionInfo, where: str, index: dict[str, TensorSpec]) -> Graph:
    if s.name == "graph":
        graph = decode_graph(raw, where)
    else:
        try:
            graph = graph_from_toml(raw, what=where)
        except GraphValidationError as e:
            raise ModelFormatError(f"{where}: {e}") from None
        problem = _weights_disagree(graph.weights, index, "the tensors index")
        if problem:  # a TOML graph may list its weights; they must agree with the index
            raise ModelFormatError(f"{where}: {problem}")
    return Graph(graph.nodes, graph.inputs, graph.outputs, dict(index))


def _weights_disagree(declared: Mapping[str, TensorSpec], index: Mapping[str, TensorSpec], other: str) -> str | None:
    """What differs between a graph's declared weights and ``other`` (names, shapes, dtypes);
    None when they agree or the graph declares none."""
    if not declared:
        return None
    missing = sorted(set(declared) - set(index))
    extra = sorted(set(index) - set(declared))
    if missing or extra:
        return (f"the graph's weights do not match {other}: not in {other} {missing[:5]}, "
                f"not in the graph {extra[:5]}")
    for name, spec in declared.items():
        if (spec.shape, spec.dtype) != (index[name].shape, index[name].dtype):
            return f"weight {name!r} is {spec} in the graph but {index[name]} in {other}"
    return None


def _validate(graph: Graph, max_memory: int | None) -> list[str]:
    from .ir.validate import validate_graph

    return validate_graph(graph, max_memory=max_memory).warnings


# -- saving ------------------------------------------------------------------------------------
def _plan_tensor(name: object, value: object) -> tuple[DType, tuple[int, ...], int, Any]:
    """(dtype, shape, nbytes, value) for one weight, without copying its data."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"weight names must be non-empty strings, got {name!r}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"weight name {name!r} is not encodable as UTF-8") from None
    if isinstance(value, QuantizedArray):
        return value.dtype, tuple(value.shape), value.data.nbytes, value
    if isinstance(value, Deferred):
        return value.dtype, tuple(value.shape), value.nbytes, value
    arr = np.asarray(value)
    dt = arr.dtype
    if dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder == "big"):
        dt = dt.newbyteorder("<")
    try:
        dtype = DType.from_numpy(dt)
    except TypeError:
        raise TypeError(
            f"weight {name!r}: numpy dtype {arr.dtype} has no .model element type; use one of "
            + ", ".join(d.name.lower() for d in DType if not d.is_quantized)
            + " or a QuantizedArray"
        ) from None
    return dtype, tuple(arr.shape), dtype.nbytes(arr.shape), arr


def _made(name: str, value: Any, dtype: DType, shape: tuple[int, ...]) -> Any:
    """``value``, made now if :class:`~.tensor.Deferred`: of the type and shape it promised."""
    if not isinstance(value, Deferred):
        return value
    made = value.make()
    got = (made.dtype, tuple(made.shape)) if isinstance(made, QuantizedArray) else (
        DType.from_numpy(made.dtype), tuple(made.shape))
    if got != (dtype, shape):
        raise ValueError(f"weight {name!r}: made as {got[0].name}{list(got[1])}, "
                         f"promised {dtype.name}{list(shape)}")
    return made


def _raw_bytes(dtype: DType, value: Any) -> np.ndarray:
    """A flat uint8 array of the little-endian, C-order bytes of a weight."""
    if isinstance(value, QuantizedArray):
        return np.ascontiguousarray(value.data).reshape(-1)
    return np.ascontiguousarray(value, dtype=dtype.numpy).reshape(-1).view(np.uint8)


def _progress(total: int, desc: str):
    if total <= _PROGRESS_THRESHOLD:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False)


def save_model(
    path: str | os.PathLike,
    graph: Graph | None,
    weights: Mapping[str, np.ndarray | QuantizedArray | Deferred],
    metadata: Mapping | None = None,
    *,
    graph_format: str = "binary",
    progress: bool = True,
) -> Model:
    """Write a ``.model`` file atomically and return it loaded (``validate=False``).

    Tensors are laid out in ``weights``' order, each at a multiple of 64 bytes; a
    :class:`~.tensor.Deferred` one is made when its turn comes and let go once written.  The stored
    graph's ``weights`` are filled from the resulting index; if ``graph.weights`` is already
    filled, its names, shapes and dtypes must agree with ``weights``.  ``graph_format``:
    ``"binary"`` (canonical ``~~~graph``) or ``"toml"`` (``~~~graph.toml``).  ``progress`` shows
    a bar while large weights are written.  The graph is not validated here; :func:`load_model`
    validates.
    """
    if graph_format not in ("binary", "toml"):
        raise ValueError(f"graph_format must be 'binary' or 'toml', got {graph_format!r}")
    path = Path(path)
    meta = dict(metadata or {})

    def meta_fail(msg: str) -> None:
        raise ValueError(msg)

    _check_metadata(meta, meta_fail)
    import tomli_w

    meta_bytes = tomli_w.dumps(meta).encode("utf-8")
    parse_toml(meta_bytes, "metadata")  # what we write must load (depth, size)

    plan = []
    index: dict[str, TensorSpec] = {}
    end = 0
    for name, value in weights.items():
        dtype, shape, nbytes, value = _plan_tensor(name, value)
        offset = _align(end)
        index[name] = TensorSpec(shape, dtype, offset, nbytes)
        plan.append((name, dtype, value))
        end = offset + nbytes

    sections: list[tuple[str, bytes]] = [("metadata.toml", meta_bytes)]
    if index:
        sections.append(("tensors.toml", encode_index(index).encode("utf-8")))
    if graph is not None:
        problem = _weights_disagree(graph.weights, index, "the weights given")
        if problem:
            raise GraphValidationError(problem)
        stored = Graph(list(graph.nodes), list(graph.inputs), list(graph.outputs), dict(index))
        if graph_format == "binary":
            sections.append(("graph", encode_graph(stored)))
        else:
            from .ir.toml_form import graph_to_toml

            sections.append(("graph.toml", graph_to_toml(stored, include_weights=False).encode("utf-8")))

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            head = encode_container(sections, end=False)
            f.write(head)
            at = len(head)
            if index:
                f.write(_header("weights", end, at))
                at = _align(at + len(f"~~~weights {end}\n")) + end
                _write_weights(f, plan, index, end, path.name if progress else None)
            f.write(_header(END, 0, at))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return load_model(path, validate=False)


def _write_weights(f, plan: Sequence, index: dict[str, TensorSpec], total: int, desc: str | None) -> None:
    bar = _progress(total, desc) if desc is not None else None
    pos = 0
    try:
        for name, dtype, value in plan:
            spec = index[name]
            if spec.offset > pos:
                f.write(bytes(spec.offset - pos))
            made = _made(name, value, dtype, spec.shape)
            raw = _raw_bytes(dtype, made)
            if raw.size != spec.size:  # cannot happen for arrays that passed _plan_tensor
                raise ValueError(f"weight {name!r}: {raw.size} bytes, expected {spec.size}")
            for i in range(0, raw.size, _WRITE_CHUNK):
                chunk = raw[i : i + _WRITE_CHUNK]
                f.write(chunk.data)
                if bar is not None:
                    bar.update(chunk.size)
            del made, raw
            chunk = None  # the last chunk is a view of this weight: hold nothing of it while the next is made
            if isinstance(value, Deferred) and value.done is not None:
                value.done()
            pos = spec.offset + spec.size
    finally:
        if bar is not None:
            bar.close()

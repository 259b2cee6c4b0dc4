"""ONNX external data: initializers whose bytes live in files beside the ``.onnx`` file.

A model over protobuf's 2 GiB limit keeps its tensors outside the protobuf: such a ``TensorProto``
has its name, element type and dims, ``data_location = EXTERNAL`` and ``external_data`` entries
``location`` (a path relative to the model's directory), ``offset`` and ``length`` (bytes; a
missing ``length`` runs to the end of the file) and ``checksum`` (SHA-1 of the file; not verified).

The file is untrusted: every entry is checked before anything is read or allocated
(:func:`external_tensor`).  ``location`` must be a relative path that, resolved (symlinks
followed), names a regular file inside the model's directory; ``offset`` and ``length`` are
decimal integers with ``offset + length`` within the file; ``length`` is exactly the tensor's
element count times its element size; other keys are refused.  Any failure is an
``OnnxImportError`` naming the tensor and the file.

:func:`split_external` reads the small external initializers (at most :data:`EAGER_BYTES`: the
shapes, scalars and index tensors that shape inference and folding need) into the model, and
returns the others as :class:`Lazy` constants, read when the ``.model`` is written: one at a time.
A Lazy one is read into :class:`Pages` of its own, given back by its ``done()`` once written.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Callable, Optional

import numpy as np
import onnx
from onnx import external_data_helper, helper

from .errors import OnnxImportError

__all__ = ["EAGER_BYTES", "ExternalTensor", "Lazy", "Pages", "external_tensor", "split_external"]

#: External initializers of at most this many bytes are read when the model is loaded; larger
#: ones stay on disk until they are written (or until a converter needs their values).
EAGER_BYTES = 64 * 1024

_KEYS = frozenset({"location", "offset", "length", "checksum"})
#: Element types stored one element per ``itemsize`` bytes (packed 4-bit types and strings are not).
_TYPES = frozenset(getattr(onnx.TensorProto, t) for t in (
    "FLOAT", "DOUBLE", "FLOAT16", "BFLOAT16", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16",
    "UINT32", "UINT64", "BOOL"))
_INT = re.compile(r"[0-9]{1,19}")


class Pages:
    """Arrays in anonymous memory maps of their own, whose pages :meth:`release` gives back at
    once, even while a view of one is still referenced (``save_model`` keeps its last chunk of a
    tensor until it writes the next): resident memory holds the tensor being written, no more."""

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        count = math.prod(shape)
        pages = mmap.mmap(-1, max(count * dtype.itemsize, 1))
        self._maps.append(pages)
        return np.frombuffer(pages, dtype, count).reshape(shape)

    def release(self) -> None:
        """Give back every array made here (their contents read as zeros afterwards)."""
        for pages in self._maps:
            if hasattr(pages, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                pages.madvise(mmap.MADV_DONTNEED)
        self._maps.clear()


@dataclass(frozen=True, eq=False)
class Lazy:
    """A constant not read yet: ``make()`` returns its array, of ``dtype`` and ``shape``, and
    ``done()`` (if given) gives back what making it took, once the array is no longer used."""

    dtype: np.dtype
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]
    done: Optional[Callable[[], None]] = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def value(self) -> np.ndarray:
        """The array, to keep: a copy, with what making it took given back."""
        array = np.array(self.make())
        if self.done is not None:
            self.done()
        return array


@dataclass(frozen=True)
class ExternalTensor:
    """Where one checked external tensor's bytes are: ``length`` bytes at ``offset`` of ``path``."""

    name: str
    path: Path  # resolved, inside the model's directory
    offset: int
    length: int
    dtype: np.dtype  # little-endian, as ONNX stores raw data
    shape: tuple[int, ...]
    label: str  # the model, for messages

    def read(self, empty: Callable[[tuple[int, ...], np.dtype], np.ndarray] = np.empty) -> np.ndarray:
        """The tensor, read from exactly its range of the file into ``empty(shape, dtype)`` (then
        the file's cached pages of that range are dropped: a conversion reads each byte once)."""
        array = empty(self.shape, self.dtype)  # length == its nbytes, checked against the file
        buffer = memoryview(array.reshape(-1).view(np.uint8))
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            raise self._fail(f"cannot be opened: {e.strerror or e}") from None
        with os.fdopen(fd, "rb", buffering=0) as f:
            if os.fstat(fd).st_size < self.offset + self.length:
                raise self._fail("is shorter than when it was checked (changed during the conversion?)")
            f.seek(self.offset)
            done = 0
            while done < self.length:
                n = f.readinto(buffer[done:])
                if not n:
                    raise self._fail(f"ended after {done} of {self.length} bytes")
                done += n
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, self.offset, self.length, os.POSIX_FADV_DONTNEED)
        return array

    def lazy(self) -> Lazy:
        pages = Pages()
        return Lazy(self.dtype, self.shape, functools.partial(self.read, pages.empty), pages.release)

    def _fail(self, what: str) -> Exception:
        return OnnxImportError(f"{self.label}: initializer {self.name!r}: external file {str(self.path)!r} {what}")


def external_tensor(tensor: onnx.TensorProto, base: Path, label: str) -> ExternalTensor:
    """Check ``tensor``'s external data against the files in ``base`` (the model's directory)."""
    def fail(what: str) -> Exception:
        return OnnxImportError(f"{label}: initializer {tensor.name!r}: external data {what}")

    entries: dict[str, str] = {}
    for e in tensor.external_data:
        if e.key not in _KEYS:
            raise fail(f"has the unknown key {e.key!r} (known: {', '.join(sorted(_KEYS))})")
        if e.key in entries:
            raise fail(f"has the key {e.key!r} twice")
        entries[e.key] = e.value
    if tensor.raw_data:
        raise fail("is given beside inline raw_data")
    dtype, shape = _element_type(tensor, fail), _dims(tensor, fail)
    path = _resolve(entries.get("location", ""), base, fail)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise fail(f"file {str(path)!r} cannot be read: {e.strerror or e}") from None
    offset = _integer(entries, "offset", 0, fail)
    if offset > size:
        raise fail(f"offset {offset} is past the end of {str(path)!r} ({size} bytes)")
    length = _integer(entries, "length", size - offset, fail)
    if offset + length > size:
        raise fail(f"offset {offset} + length {length} is past the end of {str(path)!r} ({size} bytes)")
    expected = math.prod(shape) * dtype.itemsize
    if length != expected:
        raise fail(f"length {length} in {str(path)!r} is not the {expected} bytes of "
                   f"{np.dtype(dtype).name}{list(shape)}")
    return ExternalTensor(tensor.name, path, offset, length, dtype, shape, label)


def _element_type(tensor: onnx.TensorProto, fail) -> np.dtype:
    if tensor.data_type not in _TYPES:
        name = onnx.TensorProto.DataType.Name(tensor.data_type) if tensor.data_type in \
            onnx.TensorProto.DataType.values() else str(tensor.data_type)
        raise fail(f"has element type {name}, which is not read from external files")
    return np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")


def _dims(tensor: onnx.TensorProto, fail) -> tuple[int, ...]:
    if any(d < 0 for d in tensor.dims):
        raise fail(f"has the negative dims {list(tensor.dims)}")
    return tuple(int(d) for d in tensor.dims)


def _integer(entries: dict[str, str], key: str, default: int, fail) -> int:
    if key not in entries:
        return default
    if not _INT.fullmatch(entries[key]):
        raise fail(f"{key} {entries[key][:40]!r} is not a non-negative decimal integer")
    return int(entries[key])


def _resolve(location: str, base: Path, fail) -> Path:
    """``location`` resolved inside ``base``: a relative path to a regular file that stays in it."""
    if not location or "\0" in location:
        raise fail(f"has no usable location {location[:80]!r}")
    if PurePosixPath(location).is_absolute() or PureWindowsPath(location).is_absolute() \
            or PureWindowsPath(location).drive or location.startswith(("\\", "/")):
        raise fail(f"location {location!r} is an absolute path: it must be relative to the model's directory")
    try:
        root = base.resolve()
        path = (root / location).resolve()
        inside, exists, regular = path.is_relative_to(root), path.exists(), path.is_file()
    except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a name too long...
        raise fail(f"location {location!r} cannot be resolved: {e}") from None
    if not inside:
        raise fail(f"location {location!r} resolves to {str(path)!r}, outside the model's directory "
                   f"{str(root)!r}")
    if not exists:
        raise fail(f"file {str(path)!r} does not exist")
    if not regular:
        raise fail(f"location {str(path)!r} is not a regular file")
    return path


def split_external(model: onnx.ModelProto, base: Path | None, label: str) -> dict[str, Lazy]:
    """Check every external initializer of ``model``; read the small ones into it (inline, as if
    never external); return the others, by name, as :class:`Lazy` constants."""
    external = [t for t in model.graph.initializer if external_data_helper.uses_external_data(t)]
    if external and base is None:
        names = ", ".join(t.name for t in external[:8])
        raise OnnxImportError(f"{label}: initializer(s) {names} are stored as external data: load the model "
                              f"from its file, so they can be read beside it")
    lazy = {}
    for tensor in external:
        found = external_tensor(tensor, base, label)
        if found.length > EAGER_BYTES:
            lazy[tensor.name] = found.lazy()
            continue
        tensor.raw_data = found.read().tobytes()
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
    return lazy

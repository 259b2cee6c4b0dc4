"""Tensors across process boundaries: msgpack frames, checked before anything is built.

A message is a msgpack map ``{"v": 1, "meta": {...}, "tensors": {name: frame}}`` and a frame is
``{"dtype": "f32", "shape": [2, 3], "data": <bin>}``.  dtype names are the lowercase ``DType``
names of the plain element types (no block types, no numpy type strings, so never ``'O'`` or a
structured dtype).  Decoding checks, in this order and before allocating: the message size, the
msgpack structure (with the unpacker's own length limits, no extension types), every field's type,
the dtype against the whitelist, the rank and dims, and ``len(data) == prod(shape) * itemsize``;
then the array is a zero-copy ``np.frombuffer`` view.  Nothing is ever unpickled.  Every failure
is a :class:`TransportError`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import msgpack
import numpy as np

from .dtypes import DType
from .errors import TransportError

VERSION = 1
#: A message larger than this is refused unread (the largest activation a stage sends is far less).
MAX_MESSAGE_BYTES = 100 * 2**20
MAX_RANK = 32
MAX_TENSORS = 4096
#: Arrays and maps, plus their entries, that one message may unpack to.  A message of 4,096
#: rank-32 frames needs ~170,000; without a cap, 1 MiB of empty arrays (one byte each) unpacks
#: to ~64 MiB of Python lists, and a 100 MiB message to ~7 GB.
MAX_OBJECTS = 64 * MAX_TENSORS
#: Element types that may cross the wire, by name.
WIRE_DTYPES = {d.name.lower(): d for d in DType if not d.is_quantized}


def _frame(a: np.ndarray) -> dict:
    a = a.astype(a.dtype.newbyteorder("<"), order="C", copy=False)  # keeps 0-d arrays 0-d
    try:
        dtype = DType.from_numpy(a.dtype)
    except TypeError:
        raise TransportError(f"dtype {a.dtype} cannot cross the wire") from None
    return {"dtype": dtype.name.lower(), "shape": list(a.shape), "data": a.reshape(-1).view(np.uint8).data}


def encode_message(tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None) -> bytes:
    """``tensors`` (name -> array) and JSON-like ``meta`` as one msgpack message."""
    body = {"v": VERSION, "meta": dict(meta or {}), "tensors": {n: _frame(np.asarray(a)) for n, a in tensors.items()}}
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise TransportError(f"message of {len(data):,} bytes exceeds the limit of {MAX_MESSAGE_BYTES:,}")
    return data


def _refuse_ext(code: int, data: bytes):
    raise TransportError(f"msgpack extension type {code} is not accepted")


class _Budget:
    """Counts the arrays and maps (and their entries) as msgpack builds them, and stops the
    unpacking once a message holds more than ``MAX_OBJECTS``: memory stays a constant, not a
    multiple of the message size."""

    def __init__(self) -> None:
        self.left = MAX_OBJECTS

    def _spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise TransportError(f"message holds more than {MAX_OBJECTS:,} arrays, maps and entries")

    def array(self, items: list) -> list:
        self._spend(1 + len(items))
        return items

    def map(self, items: dict) -> dict:
        self._spend(1 + 2 * len(items))
        return items


def _unpack(data: bytes) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TransportError(f"a message is bytes, not {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise TransportError(f"message of {len(data):,} bytes exceeds the limit of {MAX_MESSAGE_BYTES:,}")
    budget = _Budget()
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, ext_hook=_refuse_ext,
            list_hook=budget.array, object_hook=budget.map,
            max_bin_len=MAX_MESSAGE_BYTES, max_str_len=2**16,
            max_array_len=MAX_TENSORS, max_map_len=MAX_TENSORS, max_ext_len=0,
        )
    except TransportError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            RecursionError, MemoryError, OverflowError, UnicodeDecodeError) as e:
        raise TransportError(f"malformed msgpack message: {type(e).__name__}: {e}") from None


def _decode_frame(name: str, frame: Any) -> np.ndarray:
    where = f"tensor {name!r}"
    if not isinstance(frame, dict) or set(frame) != {"dtype", "shape", "data"}:
        raise TransportError(f"{where}: a frame is a map with exactly dtype, shape and data")
    dtype, shape, data = frame["dtype"], frame["shape"], frame["data"]
    if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
        raise TransportError(f"{where}: dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise TransportError(f"{where}: shape must be a list of at most {MAX_RANK} dims")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise TransportError(f"{where}: shape {shape!r} must hold non-negative integers")
    if not isinstance(data, bytes):
        raise TransportError(f"{where}: data must be msgpack bin")
    dt = WIRE_DTYPES[dtype]
    expected = math.prod(shape) * dt.block_bytes  # Python ints: no overflow
    if expected != len(data):
        raise TransportError(f"{where}: shape {shape} of {dtype} needs {expected:,} bytes, the frame has {len(data):,}")
    # An empty array may name any other dims; numpy refuses (ValueError) those it cannot index.
    if math.prod(d or 1 for d in shape) * dt.block_bytes > MAX_MESSAGE_BYTES:
        raise TransportError(f"{where}: shape {shape} is empty but its other dims exceed the message limit")
    return np.frombuffer(data, dtype=dt.numpy).reshape(shape)


def decode_message(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(tensors, meta) from a message; ``TransportError`` for anything malformed."""
    body = _unpack(data)
    if not isinstance(body, dict) or body.get("v") != VERSION or set(body) != {"v", "meta", "tensors"}:
        raise TransportError(f"not a version-{VERSION} message (a map with v, meta and tensors)")
    meta, tensors = body["meta"], body["tensors"]
    if not isinstance(meta, dict) or not isinstance(tensors, dict):
        raise TransportError("meta and tensors must be maps")
    return {name: _decode_frame(name, frame) for name, frame in tensors.items()}, meta

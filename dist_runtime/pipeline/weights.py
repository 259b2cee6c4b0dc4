"""Where a stage's weights come from, and proof of what it holds.

A stage maps its weights from the ``.model`` file when the file is at the same path on its node
(a shared or copied file): only the pages of its own tensors are ever read, and stages on one
machine share them through the page cache.  When the file is not there, the driver sends the
stage's tensors through the Ray object store instead.

A copy of the file at that path could be stale (another export of the same architecture), so the
driver and the stage compare a cheap fingerprint of the stage's part of the file before trusting
it: the file size, the stage's index entries, and the first and last 64 bytes of each of its
tensors -- enough to tell two random-weight exports apart without reading the tensors whole.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from ..tensor import Array, QuantizedArray

_EDGE = 64


def _raw(a: Array) -> np.ndarray:
    data = a.data if isinstance(a, QuantizedArray) else a
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def fingerprint(model, names: Iterable[str]) -> str:
    """A hex digest of the stage's part of ``model`` (see the module docstring)."""
    h = hashlib.sha256()
    h.update(str(os.path.getsize(model.path)).encode())
    for name in names:
        spec = model.index[name]
        h.update(f"{name}|{spec.dtype.name}|{list(spec.shape)}|{spec.offset}|{spec.size}".encode())
        raw = _raw(model.tensor(name))
        h.update(raw[:_EDGE].tobytes())
        h.update(raw[-_EDGE:].tobytes())
    return h.hexdigest()


def held_bytes(weights: Mapping[str, Array]) -> int:
    """Bytes of the tensors a stage holds (views count their own bytes, not the whole file)."""
    return sum(int(w.nbytes) for w in weights.values())


def resident_file_bytes(path: str | os.PathLike) -> int | None:
    """Bytes of ``path``'s mapping resident in this process (Linux ``/proc/self/smaps``), or None.

    Only the pages this process touched are counted, so it shows that a stage read its own byte
    ranges and not the whole file (up to the kernel's fault-around, 64 KiB by default, at the
    edges of what it read).
    """
    from ..arena import mappings

    target, maps = str(Path(path).resolve()), mappings()
    if maps is None:
        return None
    return sum(fields.get("Rss", 0) for _, _, name, fields in maps if name == target)

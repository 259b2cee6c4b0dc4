"""The streamed weights of a graph, copied once into one buffer of 2 MiB pages.

A decode step reads every matrix weight once, so its speed is the memory's.  With 4 KiB pages each
step also walks the page tables for every 4 KiB of weight it reads: the second-level TLB reaches 8
MiB (2048 entries), and in a virtual machine each miss walks two sets of tables.  Copied into one
buffer backed by transparent huge pages, in the order the steps read them, the weights of the 125M
Llama decode 4.5-6% faster here (16.02 against 17.10 ms a token, f32) than the same weights as a
``.model`` file's memory map (page cache, 4 KiB pages) or as separately allocated arrays.

The copy is taken when the kernel offers transparent huge pages (``always`` or ``madvise``) and the
streamed weights exceed what the TLB reaches anyway (:data:`MIN_BYTES`); otherwise the weights stay
as they were loaded.  :func:`placement` says which and why, for ``inspect --plan``.  The copies are
read-only, like the mapped weights they replace.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .tensor import Array, QuantizedArray

#: A transparent huge page on x86-64 and the alignment the kernel needs to back a range with one.
HUGE_PAGE = 2 << 20
#: Below this many bytes of streamed weights, 4 KiB pages cost nothing measurable: their pages fit
#: the second-level TLB (2048 entries x 4 KiB = 8 MiB) twice over.
MIN_BYTES = 16 << 20
#: Each weight starts on its own cache line and 4 KiB page (the kernels' prefetches stay in it).
_ALIGN = 4096
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True)
class Placement:
    """Where the streamed weights live: ``packed`` in one huge-page buffer or not, and why."""

    packed: bool
    reason: str
    nbytes: int = 0  # the streamed weights' bytes
    huge_bytes: int = 0  # of the buffer, backed by huge pages (measured after the copy)


def thp_mode(path: Path = _THP) -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or None."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def decide(nbytes: int, mode: str | None, wanted: bool | None) -> Placement:
    """Whether ``nbytes`` of streamed weights are packed (``wanted``: True/False forces, None decides)."""
    mb = f"{nbytes / 2**20:.0f} MiB of streamed weights"
    if wanted is False:
        return Placement(False, f"{mb} as loaded: huge_pages=False")
    if mode not in ("always", "madvise"):
        why = "this system has no transparent huge pages" if mode is None else f"transparent huge pages are {mode!r}"
        return Placement(False, f"{mb} as loaded: {why}")
    if wanted is None and nbytes < MIN_BYTES:
        return Placement(False, f"{mb} as loaded: under {MIN_BYTES >> 20} MiB, their 4 KiB pages fit the TLB")
    return Placement(True, f"{mb} copied into one buffer of 2 MiB pages (transparent huge pages: {mode})", nbytes)


def pack(constants: dict[str, Array], names: list[str], wanted: bool | None = None,
         release: Callable[[list[str]], object] | None = None) -> tuple[dict[str, Array], Placement]:
    """``constants`` with ``names`` (in the order the steps read them) copied into one huge-page
    buffer, when :func:`decide` says so; the others, and everything when it does not, unchanged.
    ``release([name])`` is called after each copy (the model's :meth:`~.model.Model.release`):
    the source's pages leave resident memory weight by weight, so that the copy never holds the
    weights twice over (a 3B model's peak was twice its file)."""
    sizes = [_padded(_data(constants[n]).nbytes) for n in names]
    placement = decide(sum(sizes), thp_mode(), wanted)
    if not placement.packed:
        return constants, placement
    buf = _huge_buffer(sum(sizes))
    out, at = dict(constants), 0
    for name, size in zip(names, sizes):
        out[name] = _copy_into(constants[name], buf[at:at + size])
        at += size
        if release is not None:
            release([name])
    huge = _huge_bytes(buf)
    reason = placement.reason + f"; {huge / 2**20:.0f} MiB of it in huge pages"
    return out, Placement(True, reason, placement.nbytes, huge)


def empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """``np.empty(shape, dtype)``, its whole 2 MiB pages advised into huge pages when the system
    has them (a KV cache's buffers, read whole by every decode step's attention: at context 1024
    the 125M model's attention took 184 against 201 us a layer in 4 KiB pages)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < HUGE_PAGE or thp_mode() not in ("always", "madvise"):
        return np.empty(shape, dtype)
    return _huge_buffer(nbytes).view(dtype).reshape(shape)


def _data(a: Array) -> np.ndarray:
    return a.data if isinstance(a, QuantizedArray) else a


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _huge_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` of anonymous memory starting on a 2 MiB boundary, its whole 2 MiB pages advised
    into huge pages (a last partial one stays in 4 KiB pages: no memory is taken for bytes never
    asked for).  The map is over-allocated by one huge page to find the boundary; the part before
    it is never touched, so it takes no memory."""
    # private: a shared anonymous map is shmem, whose huge pages are another setting (shmem_enabled)
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mm, np.uint8)
    start = (-whole.ctypes.data) % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE") and nbytes >= HUGE_PAGE:
        mm.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return whole[start:start + nbytes]


def _copy_into(a: Array, space: np.ndarray) -> Array:
    src = _data(a)
    view = space[:src.nbytes].view(src.dtype).reshape(src.shape)
    view[...] = src
    view.flags.writeable = False
    return QuantizedArray(view, a.dtype, a.shape) if isinstance(a, QuantizedArray) else view


def process_memory() -> dict[str, int] | None:
    """This process's resident memory now and at its peak, in bytes (``VmRSS``, ``VmHWM`` of
    ``/proc/self/status``), or None where there is no such file."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    try:
        return {"resident": int(fields["VmRSS"].split()[0]) * 1024, "peak": int(fields["VmHWM"].split()[0]) * 1024}
    except (KeyError, ValueError, IndexError):
        return None


def available_memory() -> int | None:
    """Bytes the system can give this process now without swapping (``MemAvailable`` of
    ``/proc/meminfo``, and the cgroup's limit less its usage when one is set), or None."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None
    try:  # a container's limit (cgroup v2) may be below what the host has free
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def mappings() -> list[tuple[int, int, str, dict[str, int]]] | None:
    """This process's memory mappings from ``/proc/self/smaps``: (start, end, path or "", the
    per-mapping byte counts such as ``Rss`` and ``AnonHugePages``), or None where there is none."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    out: list = []
    for line in lines:
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and not head[0].endswith(":"):  # "start-end perms offset dev inode [path]"
            lo, hi = (int(v, 16) for v in head[0].split("-"))
            out.append((lo, hi, head[5].strip() if len(head) == 6 else "", {}))
        elif out and len(head) >= 3 and head[0].endswith(":") and head[2] == "kB":
            out[-1][3][head[0][:-1]] = int(head[1]) * 1024
    return out


def _huge_bytes(buf: np.ndarray) -> int:
    """Bytes of the mapping holding ``buf`` that the kernel backs with huge pages."""
    addr = buf.ctypes.data
    return next((fields.get("AnonHugePages", 0) for lo, hi, _, fields in mappings() or [] if lo <= addr < hi), 0)

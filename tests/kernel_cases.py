"""Reference cases for kernel tests, stored as small npz files under tests/fixtures/kernels/.

A ``tests/fixtures/make_<family>_fixtures.py`` script (run by hand, with torch) writes the cases
through :class:`CaseWriter`; the tests (no torch in CI) read them with :func:`load_cases` and call
the registered kernel on each.  One case is a set of npz entries ``<name>/in0``, ``<name>/in1``, ...
(the inputs, in node order), ``<name>/expected`` (the reference output in f64, computed from the
exact input values) and ``<name>/meta``: JSON naming the op class, its payload fields and the dtype
the kernel is fed (``bf16`` inputs are stored as f32 values that bf16 holds exactly).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from dist_runtime.ir import ops

DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "f64": np.dtype(np.float64),
          "bf16": np.dtype(ml_dtypes.bfloat16)}
_STORED = {"f32": np.float32, "f16": np.float16, "f64": np.float64, "bf16": np.float32}

# Output tolerance per fed dtype, against an f64 reference.  f32: tighter than ONNX's rtol=1e-3
# but loose enough for f32 source coordinates in resampling; f16/bf16: the output is rounded once,
# by at most half an ulp, 2**-11 resp. 2**-8 of the value (11 resp. 8 significant bits), plus
# slack; f64: only a kernel that really computes in f64 gets this close.
TOLERANCES = {"f32": dict(rtol=1e-4, atol=1e-5), "f16": dict(rtol=1e-3, atol=1e-5),
              "bf16": dict(rtol=8e-3, atol=1e-5), "f64": dict(rtol=1e-12, atol=1e-12)}


def rand(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    """Standard-normal values exactly representable in ``dtype``, in the dtype they are stored in."""
    return representable(rng.standard_normal(shape), dtype)


def representable(x, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype``, in the dtype it is stored in: the value the kernel is fed."""
    return np.asarray(x).astype(DTYPES[dtype]).astype(_STORED[dtype])


class CaseWriter:
    """Collects cases and saves them as one compressed npz."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.entries: dict[str, np.ndarray] = {}

    def add(self, name: str, op: str, fields: dict, inputs: list, expected, dtype: str) -> None:
        if f"{name}/meta" in self.entries:
            raise ValueError(f"duplicate case {name}")
        getattr(ops, op)(**fields)  # fail now, not in CI, on a misspelt field
        for i, a in enumerate(inputs):
            self.entries[f"{name}/in{i}"] = np.asarray(a)
        self.entries[f"{name}/expected"] = np.asarray(expected, np.float64)
        self.entries[f"{name}/meta"] = np.array(json.dumps({"op": op, "fields": fields, "dtype": dtype}))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **self.entries)
        print(f"wrote {len(self.entries)} arrays to {path} ({path.stat().st_size} bytes)")


@dataclass
class Case:
    name: str
    op: ops.OpPayload
    inputs: list[np.ndarray]  # already in the fed dtype
    expected: np.ndarray  # f64
    dtype: str

    @property
    def tolerance(self) -> dict:
        return TOLERANCES[self.dtype]


def _stored_cases(path: Path):
    """``(name, meta, stored inputs, expected)`` of every case of an npz, in a stable order."""
    with np.load(path) as z:
        entries = {k: z[k] for k in z.files}
    for key in sorted(k for k in entries if k.endswith("/meta")):
        name = key.rsplit("/", 1)[0]
        inputs = []
        while f"{name}/in{len(inputs)}" in entries:
            inputs.append(entries[f"{name}/in{len(inputs)}"])
        yield name, json.loads(str(entries[key])), inputs, entries[f"{name}/expected"]


def load_cases(path: Path) -> list[Case]:
    """Every case of an npz written by :class:`CaseWriter`, in a stable order."""
    return [Case(name, getattr(ops, meta["op"])(**meta["fields"]),
                 [a.astype(DTYPES[meta["dtype"]]) for a in inputs], expected, meta["dtype"])
            for name, meta, inputs, expected in _stored_cases(path)]


def stored_inputs(path: Path, dtype: str) -> dict[str, np.ndarray]:
    """The inputs of the cases fed as ``dtype``, as stored (before their conversion to it)."""
    return {f"{name}/in{i}": a for name, meta, inputs, _ in _stored_cases(path)
            if meta["dtype"] == dtype for i, a in enumerate(inputs)}


def run_kernel(op, *inputs) -> tuple:
    """The registered kernel of ``op`` on ``inputs``, with a fresh context: its output tuple."""
    from dist_runtime.kernels.registry import KernelContext, kernel_for

    return kernel_for(type(op))(op, list(inputs), KernelContext())


def run_one(op, *inputs):
    """``run_kernel`` for a one-output op: the output."""
    (y,) = run_kernel(op, *inputs)
    return y

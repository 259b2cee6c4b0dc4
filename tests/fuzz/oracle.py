"""The one oracle of the fuzz tests (``tests/test_fuzz.py``) and the atheris entry points
(``tests/fuzz/fuzz_*.py``): which errors each reader of untrusted bytes may raise, what a
successful read guarantees, and how much memory a read may take.

A check function takes the bytes, runs the reader, and returns normally when the outcome is
allowed (a documented error, or a result that satisfies the reader's invariants).  Anything else
-- another exception type, a broken invariant -- propagates, which is a finding.
"""

from __future__ import annotations

import math
import os
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dist_runtime.errors import GraphValidationError, ModelFormatError, TransportError
from dist_runtime.ir.codec import decode_graph, encode_graph
from dist_runtime.ir.graph import Graph
from dist_runtime.ir.toml_form import graph_from_toml, graph_to_toml
from dist_runtime.model import load_model
from dist_runtime.transport import decode_message

MiB = 2**20

#: What each reader documents that it raises on malformed input (and nothing else may escape):
#: load_model -- ModelFormatError for the bytes, GraphValidationError for a well-formed invalid
#: graph (its docstring; UnknownTensorError only for a requested name, and the fuzzers request
#: none); decode_graph and graph_from_toml -- ModelFormatError; decode_message -- TransportError.
ALLOWED: dict[str, tuple[type[BaseException], ...]] = {
    "load_model": (ModelFormatError, GraphValidationError),
    "decode_graph": (ModelFormatError,),
    "graph_from_toml": (ModelFormatError,),
    "decode_message": (TransportError,),
}


@dataclass(frozen=True)
class MemoryBound:
    """``peak <= factor * len(input) + constant`` bytes (tracemalloc: Python's own heap)."""

    factor: int
    constant: int

    def limit(self, n: int) -> int:
        return self.factor * n + self.constant


#: Per reader.  The factors cover parsing into Python objects (TOML: ~45 bytes of objects per
#: byte of ``[[],[],...]``); the constants cover fixed costs.  decode_message's constant is
#: larger: msgpack preallocates each array's declared length (up to 4,096 slots) before its
#: items arrive, for every unfinished array up to its stack depth of 1,024 -- at most 32 MiB,
#: whatever the message -- and a message unpacks to at most transport.MAX_OBJECTS containers and
#: entries (~20 MiB).  A reader that allocated by a *claimed* count or size (2^32 nodes, a 2^40
#: element frame) breaks these bounds by orders of magnitude.
MEMORY: dict[str, MemoryBound] = {
    "load_model": MemoryBound(64, 8 * MiB),
    "decode_graph": MemoryBound(64, 4 * MiB),
    "graph_from_toml": MemoryBound(64, 4 * MiB),
    "decode_message": MemoryBound(4, 64 * MiB),
}


def _has_nan_payload(graph: Graph) -> bool:
    return any(isinstance(v, float) and math.isnan(v)
               for n in graph.nodes for v in n.op.payload().values())


def _same_graph(a: Graph, b: Graph) -> bool:
    # NaN != NaN: compare the canonical bytes instead when a payload holds one
    return a == b or (_has_nan_payload(a) and encode_graph(a) == encode_graph(b))


# -- the checks ----------------------------------------------------------------------------------
def check_decode_graph(data: bytes) -> None:
    try:
        graph = decode_graph(data)
    except ALLOWED["decode_graph"]:
        return
    # canonical: what decodes re-encodes to the same bytes (NaN payload bits may be quietened)
    assert encode_graph(graph) == data or _has_nan_payload(graph)


def check_graph_toml(data: bytes) -> None:
    try:
        graph = graph_from_toml(data)
    except ALLOWED["graph_from_toml"]:
        return
    again = graph_from_toml(graph_to_toml(graph))  # what was read can be written and read back
    assert _same_graph(again, graph)
    bare = Graph(graph.nodes, graph.inputs, graph.outputs, {})
    assert _same_graph(decode_graph(encode_graph(graph)), bare)  # ... and has a binary form


def check_transport(data: bytes) -> None:
    try:
        tensors, meta = decode_message(data)
    except ALLOWED["decode_message"]:
        return
    assert isinstance(meta, dict)
    for t in tensors.values():  # whatever decoded is a well-formed read-only view
        assert t.nbytes == math.prod(t.shape) * t.itemsize and t.dtype.kind != "O"
        assert not t.flags.writeable


def check_load_model(data: bytes, path: Path) -> None:
    """Write ``data`` to ``path`` (a fresh name each call: a live mapping of an older file must
    never be truncated under it) and load it."""
    path.write_bytes(data)
    try:
        model = load_model(path)
    except ALLOWED["load_model"]:
        return
    try:
        assert isinstance(model.metadata, dict)
        for name, arr in model.weights.items():  # every view lies inside the file
            start, size = model.byte_range(name)
            assert start % 64 == 0 and start + size <= len(data)
        if model.graph is not None:
            enc = encode_graph(model.graph)
            assert encode_graph(decode_graph(enc)) == enc
    finally:
        model.close()


CHECKS: dict[str, Callable[..., None]] = {
    "load_model": check_load_model,
    "decode_graph": check_decode_graph,
    "graph_from_toml": check_graph_toml,
    "decode_message": check_transport,
}


def peak_memory(fn: Callable[[], object]) -> int:
    """Peak bytes traced by tracemalloc while ``fn`` runs (its exceptions propagate)."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        if not was_tracing:
            tracemalloc.stop()


def check_memory(target: str, data: bytes, *args) -> int:
    """Run the target's check under tracemalloc and assert its memory bound; returns the peak."""
    peak = peak_memory(lambda: CHECKS[target](data, *args))
    limit = MEMORY[target].limit(len(data))
    assert peak <= limit, f"{target}: {peak:,} bytes for a {len(data):,}-byte input (limit {limit:,})"
    return peak


# -- seeds: small valid inputs to mutate ----------------------------------------------------------
def seeds() -> dict[str, list[bytes]]:
    """Valid inputs for every target, built from the tests' example models (conftest)."""
    import tempfile

    import numpy as np

    from conftest import mini_graph, tiny_decoder
    from dist_runtime.model import save_model
    from dist_runtime.transport import encode_message

    out: dict[str, list[bytes]] = {k: [] for k in CHECKS}
    with tempfile.TemporaryDirectory() as d:
        for build in (mini_graph, tiny_decoder):
            graph, weights, metadata = build()
            for form in ("binary", "toml"):
                p = os.path.join(d, f"{build.__name__}-{form}.model")
                save_model(p, graph, weights, metadata, graph_format=form).close()
                out["load_model"].append(Path(p).read_bytes())
            out["decode_graph"].append(encode_graph(graph))
            out["graph_from_toml"].append(graph_to_toml(graph).encode())
    out["decode_message"] += [
        encode_message({"h": np.arange(6, dtype=np.float32).reshape(2, 3),
                        "t": np.array([1, 2, 3], np.int32)}, {"session": "s", "pos": 3, "step": 1}),
        encode_message({}, {"error": {"type": "TransportError", "message": "m", "stage": 0}}),
        encode_message({"b": np.array(True), "z": np.zeros((0, 4), np.float16)}, {"warmup": True}),
    ]
    return out

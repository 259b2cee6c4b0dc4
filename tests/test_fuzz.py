"""Hostile input refused: seeded property tests over every reader of untrusted bytes.

The readers: ``load_model`` (a file), ``decode_graph`` (the ``~~~graph`` section),
``graph_from_toml`` (the ``~~~graph.toml`` section) and ``decode_message`` (a frame from another
process).  The oracle -- which errors each may raise, what a successful read guarantees, how much
memory a read may take -- lives in ``tests/fuzz/oracle.py`` and is shared with the atheris entry
points in ``tests/fuzz/`` (long runs).  This file adds what ``test_hardening.py`` (truncations,
counts, the container and index cases) and ``test_transport.py`` (the frame cases, random bytes,
byte flips) do not have: hypothesis-driven mutations of the example models in both graph forms,
structured TOML and msgpack values, memory bounds on a sample of inputs, message amplification,
a stage that keeps serving after hostile frames, and a scan for unpickling in the package.
"""

from __future__ import annotations

import ast
import copy
import math
import os
import tempfile
import tomllib
import tracemalloc
from pathlib import Path

import msgpack
import numpy as np
import pytest
import tomli_w
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import tiny_decoder
from dist_runtime.errors import DistRuntimeError, TransportError
from dist_runtime.ir.toml_form import graph_to_toml
from dist_runtime.transport import MAX_OBJECTS, MAX_TENSORS, WIRE_DTYPES, decode_message, encode_message
from fuzz import oracle

pytestmark = pytest.mark.slow  # hypothesis over every reader, thousands of examples

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
FAST = dict(derandomize=True, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SEEDS = oracle.seeds()  # valid inputs: the tests' example models in every form, sample messages


@pytest.fixture(scope="module")
def scratch():
    """A RAM directory when there is one: the load_model properties write many small files."""
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=shm, prefix="dist-runtime-fuzz-") as d:
        yield _Files(Path(d))


class _Files:
    """A fresh file name per input (a mapping of an older file is never truncated under it)."""

    def __init__(self, d: Path) -> None:
        self.d, self.n = d, 0

    def next(self) -> Path:
        self.n += 1
        old = self.d / f"f{self.n - 1}.model"
        old.unlink(missing_ok=True)
        return self.d / f"f{self.n}.model"


# -- mutations -----------------------------------------------------------------------------------
_INTERESTING = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\xff\xff\xff\xff", b"\x00\x00\x00\x80",
                b"\x00\x00\x01\x00", b"\xff\xff\xff\xff\xff\xff\xff\x7f", b"-1", b"9" * 25, b"[",
                b"]", b"{", b"=", b'"', b"\n", b"~~~", b"nan", b"inf", b"1e999"]
_ops = st.tuples(st.integers(0, 6), st.integers(0, 2**20), st.integers(0, 2**20),
                 st.sampled_from(_INTERESTING) | st.binary(min_size=1, max_size=8))


def mutate(raw: bytes, ops) -> bytes:
    """Apply hypothesis-drawn (kind, position, other position, bytes) edits to ``raw``."""
    data = bytearray(raw)
    for kind, at, other, chunk in ops:
        if not data:
            data += chunk
            continue
        at %= len(data)
        if kind == 0:
            data[at] ^= 1 << (other % 8)
        elif kind == 1:
            data[at : at + len(chunk)] = chunk  # overwrite
        elif kind == 2:
            data[at:at] = chunk  # insert
        elif kind == 3:
            del data[at : at + 1 + other % 32]
        elif kind == 4:  # duplicate a span elsewhere (repeats structure)
            j = other % len(data)
            data[at:at] = data[j : j + 1 + other % 64]
        elif kind == 5:
            del data[at:]  # truncate
        else:
            data[at] = other % 256
    return bytes(data)


class _Every:
    """True on every ``n``-th call: the sample of inputs that also get the memory check."""

    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0

    def __call__(self) -> bool:
        self.i += 1
        return self.i % self.n == 1


def _check(target: str, data: bytes, sample: _Every, *args) -> None:
    if sample():
        oracle.check_memory(target, data, *args)
    else:
        oracle.CHECKS[target](data, *args)


# -- load_model --------------------------------------------------------------------------------
_model_sample = _Every(8)


@settings(max_examples=150, **FAST)
@given(st.binary(max_size=512) | st.binary(max_size=512).map(lambda b: b"~~~model 1\n" + b))
def test_load_model_random_bytes(scratch, data):
    _check("load_model", data, _model_sample, scratch.next())


@settings(max_examples=400, **FAST)
@given(st.sampled_from(range(len(SEEDS["load_model"]))), st.lists(_ops, min_size=1, max_size=4))
def test_load_model_mutations(scratch, which, ops):
    """Mutations of the example models (mini graph and the tiny decoder; binary and TOML graph)."""
    _check("load_model", mutate(SEEDS["load_model"][which], ops), _model_sample, scratch.next())


# -- the graph readers -------------------------------------------------------------------------
_graph_sample = _Every(8)


@settings(max_examples=300, **FAST)
@given(st.sampled_from(range(len(SEEDS["decode_graph"]))), st.lists(_ops, min_size=1, max_size=4))
def test_decode_graph_mutations(which, ops):
    _check("decode_graph", mutate(SEEDS["decode_graph"][which], ops), _graph_sample)


@settings(max_examples=300, **FAST)
@given(st.sampled_from(range(len(SEEDS["graph_from_toml"]))), st.lists(_ops, min_size=1, max_size=4))
def test_graph_toml_byte_mutations(which, ops):
    _check("graph_from_toml", mutate(SEEDS["graph_from_toml"][which], ops), _graph_sample)


_TOML_DOC = tomllib.loads(graph_to_toml(tiny_decoder()[0]))
_toml_scalars = (st.integers(-(2**64), 2**64) | st.sampled_from([-2, -1, 0, 1, 255, 256, 2**32])
                 | st.floats(width=64) | st.booleans()
                 | st.sampled_from(["", "f32", "q8_0", "F32", "Matmul", "pos", "tokens", "\x00", "é"]))
_toml_values = st.recursive(_toml_scalars, lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(st.sampled_from(["id", "op", "shape", "dtype", "eps", "x"]),
                                              inner, max_size=3), max_leaves=8)


def _paths(obj, path=()):
    yield path
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, (*path, k))


@settings(max_examples=100, **FAST)
@given(st.data())
def test_graph_toml_value_mutations(data):
    """Well-formed TOML with wrong values: a leaf or table of the tiny decoder's graph.toml
    replaced by any TOML value, deleted, or given an unknown key."""
    doc = copy.deepcopy(_TOML_DOC)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        path = data.draw(st.sampled_from(paths))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        action = data.draw(st.integers(0, 5))
        if action == 0:
            del parent[path[-1]]
        elif action == 1 and isinstance(parent, dict):
            parent[data.draw(st.sampled_from(["extra", "payload", "attrs", "offset", "size", "name"]))] = \
                data.draw(_toml_values)
        else:
            parent[path[-1]] = data.draw(_toml_values)
    text = tomli_w.dumps(doc).encode()
    _check("graph_from_toml", text, _graph_sample)


# -- the transport decoder: structured messages -------------------------------------------------
_mp_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
               | st.text(max_size=8) | st.binary(max_size=16)
               | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4))
               | st.builds(msgpack.Timestamp, st.integers(0, 2**34), st.integers(0, 999_999_999)))
_mp_values = st.recursive(_mp_scalars, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=12)
_dtypes = (st.sampled_from(sorted(WIRE_DTYPES))
           | st.sampled_from(["O", "<f4", "object", "[('a','<f4')]", "V8", "q8_0", "q4_0", "F32", "", "f32\x00"])
           | _mp_values)
_dims = (st.integers(-3, 8) | st.just(0) | st.sampled_from([2**31, 2**32, 2**40, 2**62, 2**63, 2**64 - 1])
         | _mp_values)
_shapes = (st.lists(_dims, max_size=6) | st.lists(_dims, max_size=4).map(lambda s: [*s, 0])  # empty
           | st.sampled_from([[1] * 33, [0] * 40]) | _mp_values)


@st.composite
def _frames(draw):
    frame = {"dtype": draw(_dtypes), "shape": draw(_shapes), "data": b""}
    shape = frame["shape"]
    if isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) \
            and math.prod(shape) <= 512:  # often the right size, for some dtype
        n = math.prod(shape) * draw(st.sampled_from([1, 2, 4, 8]))
        frame["data"] = bytes(n + draw(st.sampled_from([0, 0, 0, 1, -1])) * (n > 0))
    else:
        frame["data"] = draw(st.binary(max_size=64) | _mp_values)
    if draw(st.integers(0, 9)) == 0:
        del frame[draw(st.sampled_from(sorted(frame)))]
    if draw(st.integers(0, 9)) == 0:
        frame[draw(st.text(max_size=3))] = draw(_mp_values)
    return frame


@st.composite
def _messages(draw):
    # mostly a well-formed envelope, so that the frames' own fields are what is tested
    mostly = lambda good, bad: st.one_of(good, good, good, bad)  # noqa: E731
    body = {"v": draw(mostly(st.just(1), _mp_scalars)),
            "meta": draw(mostly(st.dictionaries(st.text(max_size=6), _mp_values, max_size=4), _mp_values)),
            "tensors": draw(mostly(st.dictionaries(st.text(max_size=4), _frames(), min_size=1, max_size=3),
                                   _mp_values))}
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.sampled_from(["x", "v", "meta"]))] = draw(_mp_values)
    return msgpack.packb(body, use_bin_type=True)


_message_sample = _Every(8)


@settings(max_examples=250, **FAST)
@given(_messages())
def test_transport_structured_messages(data):
    """Well-formed msgpack carrying any values where the frames' fields go: only
    TransportError, and what decodes is a well-formed read-only array."""
    _check("decode_message", data, _message_sample)


_int_dims = st.integers(0, 4) | st.sampled_from([0, 2**31 - 1, 2**32, 2**48, 2**62, 2**63 - 1, 2**63, 2**64 - 1])


@settings(max_examples=200, **FAST)
@given(st.sampled_from(sorted(WIRE_DTYPES)), st.lists(_int_dims, max_size=5), st.integers(-1, 1))
def test_transport_integer_shapes(dtype, shape, off_by):
    """Frames whose every field is well typed: only the numbers are hostile (huge dims, dims
    whose product overflows, zero-size arrays with huge other dims, a byte count off by one)."""
    n = math.prod(shape) * WIRE_DTYPES[dtype].block_bytes
    data = bytes(max(n + off_by, 0)) if n <= 4096 else bytes(8)
    _check("decode_message", _msg({"dtype": dtype, "shape": shape, "data": data}), _message_sample)


@settings(max_examples=200, **FAST)
@given(st.sampled_from(range(len(SEEDS["decode_message"]))), st.lists(_ops, min_size=1, max_size=4))
def test_transport_mutations(which, ops):
    _check("decode_message", mutate(SEEDS["decode_message"][which], ops), _message_sample)


# -- transport frames not covered by test_transport.py's HOSTILE table -------------------------
def _msg(frame=None, meta=None, tensors=None) -> bytes:
    f = {"dtype": "f32", "shape": [2], "data": b"\0" * 8}
    f.update(frame or {})
    body = {"v": 1, "meta": meta or {}, "tensors": tensors if tensors is not None else {"x": f}}
    return msgpack.packb(body, use_bin_type=True)


def _head(tensors_map_header: bytes) -> bytes:
    return (b"\x83" + msgpack.packb("v") + b"\x01" + msgpack.packb("meta") + b"\x80"
            + msgpack.packb("tensors") + tensors_map_header)


HOSTILE = {
    "string dim": (_msg({"shape": ["2"]}), "non-negative integers"),
    "nil dim": (_msg({"shape": [None]}), "non-negative integers"),
    "nested list dim": (_msg({"shape": [[2]]}), "non-negative integers"),
    "dim 2**64-1": (_msg({"shape": [2**64 - 1]}), "needs 73,786,976,294,838,206,460 bytes"),
    "dims whose product overflows i64": (_msg({"shape": [2**32, 2**32, 2**32]}), "needs"),
    "zero dim beside a huge one": (_msg({"shape": [0, 2**63], "data": b""}), "is empty but its other dims"),
    "zero dim beside small ones": (_msg({"shape": [0, 2**20, 3], "data": b""}), None),
    "shape not a list": (_msg({"shape": 2}), "list of at most 32 dims"),
    "ndim 4096": (_msg({"shape": [1] * 4096}), "list of at most 32 dims"),
    "ndim 4097 (over the unpacker's array limit)": (_msg({"shape": [1] * 4097}), "malformed msgpack"),
    "ndim 2**32-1 claimed": (_head(b"\x81\xa1x\x83\xa5dtype\xa3f32\xa5shape\xdd\xff\xff\xff\xff"), "malformed msgpack"),
    "4097 tensors": (_msg(tensors={str(i): 0 for i in range(MAX_TENSORS + 1)}), "malformed msgpack"),
    "tensors map claims 2**32-1": (_head(b"\xdf\xff\xff\xff\xff"), "malformed msgpack"),
    "dtype name as bin": (_msg({"dtype": b"f32"}), "is not one of"),
    "dtype nil": (_msg({"dtype": None}), "is not one of"),
    "dtype 'V8' (void)": (_msg({"dtype": "V8"}), "is not one of"),
    "dtype '|O' (object, with byte order)": (_msg({"dtype": "|O"}), "is not one of"),
    "dtype 'O' with matching size": (_msg({"dtype": "O", "data": b"\0" * 16}), "is not one of"),
    "extension type in a frame": (_msg({"data": msgpack.ExtType(1, b"\0" * 8)}), "max_ext_len"),
    "timestamp extension (-1)": (_msg(meta={"t": msgpack.Timestamp(0)}), "max_ext_len"),
    "non-str map key": (msgpack.packb({1: 1}), "malformed msgpack"),
    "string over 64 KiB": (_msg(meta={"k": "a" * (2**16 + 1)}), "malformed msgpack"),
    "bin claims 101 MiB": (_head(b"\x81\xa1x\x83\xa5dtype\xa3f32\xa5shape\x91\x01\xa4data\xc6"
                                 + (101 * MiB).to_bytes(4, "big")), "malformed msgpack"),
    "message of 1 MiB of empty arrays": (_head(b"\x80")[:-1] + b"\xdc\x01\x00" + (b"\xdc\x10\x00" + b"\x90" * 4096) * 256,
                                         "more than"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_more_hostile_frames(case):
    data, message = HOSTILE[case]
    tracemalloc.start()
    try:
        if message is None:  # accepted: an empty array, whatever its other dims
            tensors, _ = decode_message(data)
            assert tensors["x"].size == 0 and tensors["x"].shape == (0, 2**20, 3)
        else:
            with pytest.raises(TransportError, match=message):
                decode_message(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MiB + 4 * len(data), f"{case}: {peak:,} bytes allocated"


def test_a_message_unpacks_to_a_bounded_number_of_objects():
    """1 byte of msgpack (an empty array or map) is a 56-64 byte Python object, so unpacked
    without a count of objects a 4 MiB message of them takes ~280 MB and a 100 MiB one ~7 GB; the
    unpacker counts them, and memory stays constant whatever the message size."""
    for empty in (b"\x90", b"\x80", b"\xc0"):  # [], {}, nil
        for outer in (64, 1024):
            data = b"\xdc" + outer.to_bytes(2, "big") + (b"\xdc\x10\x00" + empty * 4096) * outer
            tracemalloc.start()
            try:
                with pytest.raises(TransportError, match="more than 262,144"):
                    decode_message(data)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < 24 * MiB, (empty, len(data), peak)
    # ... and the cap is above what the largest legal message holds: MAX_TENSORS rank-32 frames
    big = {str(i): np.zeros([1] * 32, np.uint8) for i in range(MAX_TENSORS)}
    assert len(decode_message(encode_message(big, {"session": 1}))[0]) == MAX_TENSORS
    assert MAX_OBJECTS >= MAX_TENSORS * (1 + 2 * 3 + 1 + 32) + 2 * MAX_TENSORS + 64


def test_unfinished_arrays_cost_a_bounded_constant():
    """msgpack preallocates an array's declared length before its items arrive; nested,
    unfinished arrays (each claiming 4,096 items) are bounded by its stack depth: a few KiB of
    input cost at most ~32 MiB, never more (oracle.MEMORY's constant for decode_message)."""
    for depth in (500, 1000, 5000):
        data = b"\xdc\x10\x00" * depth
        tracemalloc.start()
        try:
            with pytest.raises(TransportError, match="malformed msgpack"):
                decode_message(data)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= oracle.MEMORY["decode_message"].limit(len(data)), (depth, peak)
        assert peak < 40 * MiB


def test_the_memory_oracle_can_fail(monkeypatch):
    """The bound catches a reader that allocates by a claimed size, and an exception outside
    ALLOWED escapes a check."""
    monkeypatch.setitem(oracle.MEMORY, "greedy", oracle.MemoryBound(4, 1 * MiB))
    monkeypatch.setitem(oracle.CHECKS, "greedy", lambda data: bytearray(16 * MiB))
    with pytest.raises(AssertionError, match="limit"):
        oracle.check_memory("greedy", b"tiny")

    def undocumented(data):
        raise ValueError("not a documented error")

    monkeypatch.setattr(oracle, "decode_message", undocumented)
    with pytest.raises(ValueError):
        oracle.check_transport(b"")


# -- a stage keeps serving -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def stage_pair(tmp_path_factory):
    """Two in-process stages of a 2-layer example model, the message stage 1 receives for a
    hostile session, and stage 1's reply for a fresh good session (the baseline)."""
    from conftest import save_example
    from dist_runtime.examples import LlamaConfig
    from dist_runtime.model import load_model
    from dist_runtime.pipeline.launch import make_plan
    from dist_runtime.pipeline.stage import StageWorker
    from dist_runtime.pipeline.subgraph import stages_for_plan

    path = save_example(tmp_path_factory.mktemp("fuzz-stage") / "m.model",
                        LlamaConfig(vocab=32, hidden=16, layers=2, heads=2, kv_heads=1, ffn=32), seed=7)
    with load_model(path, tensors=[]) as m:
        stages = stages_for_plan(m.graph, make_plan(m.graph, stages=2, max_context=32))
    first, second = (StageWorker(s, fuse=False) for s in stages)
    for w in (first, second):
        assert w.load_file(str(path))["loaded"]
    hostile = first.step(_tokens([1, 2, 3], "hostile-session", 0))
    good = first.step(_tokens([4, 5], "good", 0))
    baseline = decode_message(second.step(good))[0]
    for w in (first, second):
        w.close_session("hostile-session")
        w.close_session("good")
    return second, hostile, good, baseline


def _tokens(tokens, session, pos):
    return encode_message({"tokens": np.asarray(tokens, np.int32)},
                          {"session": session, "pos": pos, "step": 1, "logits": "all"})


@st.composite
def _semantic_edits(draw, frame: bytes):
    """A decodable message for the hostile session with one wrong part: dtype, shape, position,
    step, session type, or a missing / extra tensor."""
    tensors, meta = decode_message(frame)
    tensors, meta = dict(tensors), dict(meta)
    name = sorted(tensors)[0]
    kind = draw(st.integers(0, 5))
    if kind == 0:
        tensors[name] = np.zeros(tensors[name].shape, draw(st.sampled_from(
            [np.float16, np.float64, np.int32, np.int8, np.bool_, np.uint8])))
    elif kind == 1:
        tensors[name] = np.zeros(draw(st.lists(st.integers(0, 40), max_size=4)), np.float32)
    elif kind == 2:
        meta[draw(st.sampled_from(["pos", "step", "session", "reset", "logits"]))] = draw(
            st.sampled_from([-1, 31, 32, 33, 10**6, 2**40, None, True, [1], "all", 1.5]))
    elif kind == 3:
        del tensors[name]
    elif kind == 4:
        tensors["extra"] = np.zeros(1, np.float32)
    else:
        tensors[name] = np.full(tensors[name].shape, draw(st.sampled_from([np.nan, np.inf, 3e38])),
                                np.float32)
    return encode_message(tensors, meta)


@settings(max_examples=120, **FAST)
@given(st.data())
def test_stage_keeps_serving_after_hostile_frames(stage_pair, data):
    """A stage given hostile frames for one session fails those calls only -- with a
    TransportError when the frame does not decode, a DistRuntimeError otherwise -- and then
    serves another session's frame exactly as before (bit-identical)."""
    stage, hostile, good, baseline = stage_pair
    frames = data.draw(st.lists(
        st.lists(_ops, min_size=1, max_size=3).map(lambda ops: mutate(hostile, ops))
        | _semantic_edits(hostile), min_size=1, max_size=3))
    for frame in frames:
        try:
            decoded = decode_message(frame)
        except TransportError:
            decoded = None
        assume(decoded is None or decoded[1].get("session") != "good")
        try:
            stage.step(frame)
        except DistRuntimeError as e:
            assert decoded is not None or isinstance(e, TransportError), e
    reply = decode_message(stage.step(good))[0]
    try:
        assert reply.keys() == baseline.keys()
        for k in reply:
            np.testing.assert_array_equal(reply[k], baseline[k])
    finally:
        for sid in stage.sessions():
            stage.close_session(sid)


# -- nothing is unpickled --------------------------------------------------------------------------
_UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve",
                   "joblib", "pickletools", "copyreg", "jsonpickle"}
_UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}
_SAFE_KEYWORDS = {  # call (attribute name on a module alias) -> the keyword it must pass, and value
    ("np", "load"): ("allow_pickle", False), ("numpy", "load"): ("allow_pickle", False),
    ("torch", "load"): ("weights_only", True),
}
#: (path, finding) -> why it is fine.  Keep it short: every entry must still match something.
ALLOWED_FINDINGS: dict[tuple[str, str], str] = {}


def unsafe_calls(source: str) -> list[str]:
    """What in ``source`` can run code from data: pickle-family imports, eval/exec/compile,
    np.load / torch.load without their safe keyword, any allow_pickle=True, yaml.load without a
    safe loader, and Ray's own serializer hooks used directly."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in _UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _UNSAFE_MODULES:
            found.append(f"from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            kw = {k.arg: k.value for k in node.keywords}
            if isinstance(f, ast.Name) and f.id in _UNSAFE_BUILTINS:
                found.append(f"{f.id}()")
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                key = (f.value.id, f.attr)
                if key in _SAFE_KEYWORDS:
                    arg, want = _SAFE_KEYWORDS[key]
                    if not (isinstance(kw.get(arg), ast.Constant) and kw[arg].value is want):
                        found.append(f"{key[0]}.{key[1]}() without {arg}={want}")
                if f.value.id == "yaml" and f.attr in ("load", "load_all", "unsafe_load", "full_load"):
                    loader = kw.get("Loader")
                    if f.attr in ("unsafe_load", "full_load") or not (
                            isinstance(loader, ast.Attribute) and loader.attr in ("SafeLoader", "CSafeLoader")):
                        found.append(f"yaml.{f.attr}() without a safe loader")
                if f.value.id == "ray" and f.attr in ("register_serializer",):
                    found.append(f"ray.{f.attr}()")
            if "allow_pickle" in kw and not (isinstance(kw["allow_pickle"], ast.Constant)
                                             and kw["allow_pickle"].value is False):
                found.append("allow_pickle not False")
            if isinstance(f, ast.Attribute) and f.attr in ("loads", "load") and isinstance(f.value, ast.Name) \
                    and f.value.id in _UNSAFE_MODULES:
                found.append(f"{f.value.id}.{f.attr}()")
    return found


def test_the_unpickling_scan_finds_what_it_looks_for():
    bad = """
import pickle
import marshal as m
from cloudpickle import loads
import numpy as np
eval("1")
exec("x = 1")
compile("1", "f", "eval")
np.load("a.npy")
np.load("a.npy", allow_pickle=True)
np.lib.format.read_array(f, allow_pickle=True)
torch.load("w.pt")
yaml.load(s)
yaml.load(s, Loader=yaml.Loader)
dill.loads(b"")
"""
    assert unsafe_calls(bad) == [
        "import pickle", "import marshal", "from cloudpickle import", "eval()", "exec()",
        "compile()", "np.load() without allow_pickle=False", "np.load() without allow_pickle=False",
        "allow_pickle not False", "allow_pickle not False", "torch.load() without weights_only=True",
        "yaml.load() without a safe loader", "yaml.load() without a safe loader", "dill.loads()"]
    good = """
import re, numpy as np, msgpack, json
re.compile("x")
np.load("a.npy", allow_pickle=False)
torch.load("w.pt", weights_only=True)
yaml.load(s, Loader=yaml.SafeLoader)
msgpack.unpackb(b"", raw=False)
json.loads("1")
model.eval()
ray.get(ref)
"""
    assert unsafe_calls(good) == []


def test_nothing_unpickled_in_the_package():
    """The runtime never turns bytes into code: no pickle-family module, eval/exec/compile,
    unsafe np.load / torch.load / yaml.load in dist_runtime/, kernels/ or partitioner/.  (Ray
    serializes its own task arguments and results with pickle between the processes of one
    cluster -- that is Ray's, outside this scan, and why the cluster must be trusted:
    docs/security.md.)"""
    found: dict[tuple[str, str], int] = {}
    files = [p for d in ("dist_runtime", "kernels", "partitioner") for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 30
    for path in files:
        rel = str(path.relative_to(ROOT))
        for finding in unsafe_calls(path.read_text(encoding="utf-8")):
            found[(rel, finding)] = found.get((rel, finding), 0) + 1
    unexpected = {k: v for k, v in found.items() if k not in ALLOWED_FINDINGS}
    assert not unexpected, f"code that can run data, outside the allow-list: {unexpected}"
    stale = set(ALLOWED_FINDINGS) - set(found)
    assert not stale, f"allow-list entries that no longer match anything: {stale}"

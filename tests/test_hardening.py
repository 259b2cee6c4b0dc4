"""Malformed .model files and graph blobs: only the documented errors, never a crash or a hang.

Everything is seeded.  Loading a malformed file may raise only ``ModelFormatError`` (the bytes)
or ``GraphValidationError`` (a well-formed but invalid graph); a mutated file that still loads must
satisfy every invariant the loader promises.
"""

from __future__ import annotations

import math
import os
import random
import re
import struct
import tempfile
import tomllib
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import mini_graph, tiny_decoder
from dist_runtime.dtypes import DType
from dist_runtime.errors import GraphValidationError, ModelFormatError
from dist_runtime.ir.codec import decode_graph, encode_graph
from dist_runtime.ir.graph import Graph, Node, TensorSpec
from dist_runtime.ir.ops import OPS_BY_TAG, Reshape, RmsNorm
from dist_runtime.model import (
    ALIGN,
    MAX_TOML_BYTES,
    Model,
    encode_container,
    load_model,
    save_model,
)
from dist_runtime.safe_toml import MAX_TOML_DEPTH, parse_toml
from dist_runtime.tensor import QuantizedArray

ALLOWED = (ModelFormatError, GraphValidationError)
MB = 2**20


# -- helpers -----------------------------------------------------------------------------------
class Files:
    """Writes each byte string to a new file and unlinks the previous one, so that a mapping of
    an earlier file is never truncated under a live view (which would be a SIGBUS).  (A new
    name plus unlink is several times faster than os.replace on a journaling file system.)"""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.count = 0
        self.path: Path | None = None

    def write(self, data: bytes) -> Path:
        old, self.count = self.path, self.count + 1
        self.path = self.dir / f"f{self.count}.model"
        self.path.write_bytes(data)
        if old is not None:
            old.unlink()
        return self.path


_SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.fixture
def scratch(tmp_path):
    """A directory for the many small files of the fuzz loops: in RAM (/dev/shm) when there is
    one, since file creation on a disk-backed /tmp costs more than loading the file."""
    if _SHM is None:
        yield tmp_path
    else:
        with tempfile.TemporaryDirectory(dir=_SHM, prefix="dist-runtime-") as d:
            yield Path(d)


def load_or_error(path: Path, **kw) -> Model | Exception:
    try:
        return load_model(path, **kw)
    except ALLOWED as e:
        return e


def saved_bytes(tmp_path: Path, graph, weights, metadata, **kw) -> bytes:
    path = tmp_path / "base.model"
    save_model(path, graph, weights, metadata, **kw).close()
    return path.read_bytes()


def section(model_or_sections, name):
    sections = getattr(model_or_sections, "sections", model_or_sections)
    return next(s for s in sections if s.name == name)


def check_invariants(m: Model, raw: bytes) -> None:
    """What a successfully loaded model guarantees, whatever the file."""
    pos = None
    for s in m.sections:
        assert s.offset % ALIGN == 0 and s.header_offset < s.offset
        assert pos is None or s.header_offset == pos
        pos = s.end
    assert pos == len(raw)
    assert isinstance(m.metadata, dict)
    for key, typ in (("name", str), ("architecture", str), ("max_memory", int), ("created_by", str)):
        assert key not in m.metadata or type(m.metadata[key]) is typ
    spans = []
    if m.index:
        w = section(m, "weights")
        for name, spec in m.index.items():
            assert isinstance(name, str) and name
            assert spec.offset % ALIGN == 0 and spec.size == spec.dtype.nbytes(spec.shape)
            assert spec.offset + spec.size <= w.size and len(spec.shape) <= 64
            if spec.size:
                spans.append((spec.offset, spec.offset + spec.size))
        spans.sort()
        assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))
    base = np.frombuffer(m._mm, np.uint8)
    for name, arr in m.weights.items():
        spec = m.index[name]
        data = arr.data if isinstance(arr, QuantizedArray) else arr
        assert tuple(arr.shape) == spec.shape and data.nbytes == spec.size
        if spec.size:
            assert np.shares_memory(data, base)
            off = data.__array_interface__["data"][0] - base.__array_interface__["data"][0]
            assert (off, spec.size) == m.byte_range(name)
        if isinstance(arr, np.ndarray) and spec.dtype is DType.BOOL and arr.size:
            assert arr.view(np.uint8).max() <= 1
    if m.graph is not None:
        assert m.graph.weights == m.index
        enc = encode_graph(m.graph)
        assert encode_graph(decode_graph(enc)) == enc
        if m.graph_format == "binary":
            g = section(m, "graph")
            # canonical: re-encoding gives the section's bytes (NaN payload bits may be quietened)
            assert enc == raw[g.offset : g.end] or _has_nan_payload(m.graph)


def _has_nan_payload(graph: Graph) -> bool:
    return any(isinstance(v, float) and math.isnan(v)
               for n in graph.nodes for v in n.op.payload().values())


_WIRE_BYTES = {"u8": 1, "u32": 4, "i32": 4, "f32": 4, "bool": 1, "dtype": 1}


def graph_fields(raw: bytes) -> list[tuple[int, str]]:
    """Offsets of every u32 count and length in a canonical graph blob, found by walking the
    layout exactly as docs/format.md describes it (an independent reader of the format)."""
    fields: list[tuple[int, str]] = []
    pos = 0

    def u32(kind: str) -> int:
        nonlocal pos
        fields.append((pos, kind))
        pos += 4
        return int.from_bytes(raw[pos - 4 : pos], "little")

    def strings(kind: str) -> None:
        nonlocal pos
        for j in range(u32(f"{kind} count")):
            n = u32(f"{kind}[{j}] length")  # (pos += u32() would read pos before u32 moves it)
            pos += n

    for i in range(u32("num_nodes")):
        pos += 4  # id
        tag = int.from_bytes(raw[pos : pos + 2], "little")
        pos += 2
        for f in OPS_BY_TAG[tag].fields:
            if f.wire.name == "i64[]":
                n = u32(f"node[{i}].{f.name} count")
                pos += 8 * n
            else:
                pos += _WIRE_BYTES[f.wire.name]
        strings(f"node[{i}].inputs")
        strings(f"node[{i}].outputs")
        pos += 1 + raw[pos]  # has_backend_hint [, backend_hint]
    for i in range(u32("num_inputs")):
        rank = u32(f"input[{i}] rank")
        pos += 8 * rank + 1
        pos += 1 + 16 * raw[pos]  # has_offset [, offset, size]
    strings("outputs")
    assert pos == len(raw), "the documented layout does not account for every byte"
    return fields


def counts_graph() -> tuple[Graph, dict]:
    """A graph with every kind of count: nodes, node inputs/outputs, an Ints payload, graph
    inputs with ranks, outputs."""
    nodes = [
        Node(0, Reshape(shape=(2, -1)), ["x"], ["y"]),
        Node(1, RmsNorm(eps=1e-6), ["y", "w"], ["z"], backend_hint=0),
    ]
    graph = Graph(nodes, [TensorSpec((4, 4), DType.F32)], ["z"], {})
    return graph, {"w": np.ones(8, np.float32)}


# -- truncation --------------------------------------------------------------------------------
def test_truncation_at_every_header_and_graph_byte(scratch):
    graph, weights, metadata = tiny_decoder()
    raw = saved_bytes(scratch, graph, weights, metadata)
    files = Files(scratch)
    with load_model(files.write(raw)) as m:
        meta_end = section(m, "metadata.toml").end
        w = section(m, "weights")
    assert w.offset > 3000  # magic, metadata, index and graph: every byte before the weights
    rng = random.Random(1)
    cuts = list(range(w.offset + 1)) + sorted(rng.sample(range(w.offset + 1, len(raw)), 300))
    for cut in cuts:
        out = load_or_error(files.write(raw[:cut]))
        # Every prefix lacks the final 'end' section, even one that stops exactly at a section
        # boundary such as the end of metadata.toml (see docs/format.md, "Truncation").
        assert isinstance(out, ModelFormatError), (cut, out)


def test_truncated_toml_graph(scratch):
    graph, weights, metadata = mini_graph()
    raw = saved_bytes(scratch, graph, weights, metadata, graph_format="toml")
    files = Files(scratch)
    with load_model(files.write(raw)) as m:
        g = section(m, "graph.toml")
        meta_end = section(m, "metadata.toml").end
    for cut in range(g.header_offset, section(m, "weights").offset + 1):
        out = load_or_error(files.write(raw[:cut]))
        assert isinstance(out, ModelFormatError) or cut == meta_end, (cut, out)


# -- random mutations --------------------------------------------------------------------------
_INTERESTING_U32 = [0, 1, 2, 63, 64, 65, 127, 128, 255, 256, 0x7FFF, 0xFFFF, 0x10000,
                    0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]
_INTERESTING_NUMBERS = ["0", "-1", "1", "63", "64", "65", "4294967295", "18446744073709551616",
                        "9223372036854775807", "-9223372036854775808", "99999999999999999999999",
                        "1.5", "true", "inf", "nan", '"7"', "[]", "[1, 2]", "1e400", "0x40",
                        "+64", "1_000", "0064", "1" * 30]
_INTERESTING_STRINGS = ['"f32"', '"q8_0"', '"q4_0"', '"bf16"', '"bool"', '"F32"', '"f33"', '""',
                        '"lm_head.weight"', '"model.norm.weight"', '"x"', "3", "[1]", '"\\u0000"',
                        '"Matmul"', '"Reshape"', '"Bogus"', '"tokens"', '"logits"', '"pos"']


def mutate(raw: bytes, rng: random.Random, hot: int) -> bytes:
    """One to three random mutations; ``hot`` bytes at the start (everything before the weights
    data) are chosen more often than the weights themselves."""
    data = bytearray(raw)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        n = len(data)
        if n == 0:
            break
        at = rng.randrange(hot if rng.random() < 0.85 and hot < n else n)
        kind = rng.randrange(12)
        if kind == 0:
            data[at] ^= 1 << rng.randrange(8)
        elif kind == 1:
            data[at] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        elif kind == 2:
            data[at : at + 4] = struct.pack("<I", rng.choice(_INTERESTING_U32))
        elif kind == 3:
            data[at : at + 8] = struct.pack("<q", rng.choice((-1, 2**63 - 1, -(2**63), 2**32, 64)))
        elif kind == 4:
            del data[at : at + rng.randint(1, 16)]
        elif kind == 5:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif kind == 6:
            j = rng.randrange(n)
            data[at:at] = data[j : j + rng.randint(1, 64)]
        elif kind == 7:
            del data[rng.randrange(n) :]
        elif kind in (8, 9):  # a number in a TOML section or a header size
            text = bytes(data[:hot])
            spans = [m.span() for m in re.finditer(rb"-?\d+(?:\.\d+)?", text)]
            if spans:
                a, b = rng.choice(spans)
                data[a:b] = rng.choice(_INTERESTING_NUMBERS).encode()
        elif kind == 10:  # a quoted string or value in a TOML section
            text = bytes(data[:hot])
            spans = [m.span() for m in re.finditer(rb'"[^"\n]*"', text)]
            if spans:
                a, b = rng.choice(spans)
                data[a:b] = rng.choice(_INTERESTING_STRINGS).encode()
        else:  # a section header's size, nudged
            heads = [m for m in re.finditer(rb"~~~[A-Za-z0-9._-]+ (\d+)\n", bytes(data[:hot]))]
            if heads:
                m = rng.choice(heads)
                size = int(m.group(1)) + rng.choice((-64, -1, 1, 63, 64, 10**18))
                data[m.start(1) : m.end(1)] = str(max(size, 0)).encode()
    return bytes(data)


@pytest.mark.slow  # fuzzing: 12,000 mutated files
@pytest.mark.parametrize("graph_format, count", [("binary", 10_000), ("toml", 2_000)])
def test_random_mutations(scratch, graph_format, count):
    graph, weights, metadata = mini_graph()
    raw = saved_bytes(scratch, graph, weights, metadata, graph_format=graph_format)
    files = Files(scratch)
    with load_model(files.write(raw)) as m:
        hot = section(m, "weights").offset
        check_invariants(m, raw)
    rng = random.Random(f"mutations-{graph_format}")
    outcomes = {"loaded": 0, "ModelFormatError": 0, "GraphValidationError": 0}
    for i in range(count):
        bad = mutate(raw, rng, hot)
        out = load_or_error(files.write(bad))
        if isinstance(out, Model):
            try:
                check_invariants(out, bad)
            finally:
                out.close()
            outcomes["loaded"] += 1
        else:
            outcomes[type(out).__name__] += 1
    # the fuzzer reaches every outcome: it is neither all noise nor all harmless
    assert all(v > count // 200 for v in outcomes.values()), outcomes


# -- hostile counts and sizes ------------------------------------------------------------------
def test_every_graph_count_at_u32_max_fails_fast_without_allocating(scratch):
    graph, weights = counts_graph()
    raw = saved_bytes(scratch, graph, weights, {})
    files = Files(scratch)
    with load_model(files.write(raw)) as m:
        g = section(m, "graph")
    blob = raw[g.offset : g.end]
    fields = graph_fields(blob)
    kinds = {re.sub(r"\[\d+\]", "[]", k) for _, k in fields}
    assert {"num_nodes", "num_inputs", "outputs count", "node[].inputs count",
            "node[].outputs count", "node[].shape count", "input[] rank",
            "node[].inputs[] length", "outputs[] length"} <= kinds
    for pos, kind in fields:
        for value in (2**32 - 1, 2**31, len(blob) - pos - 3):
            patched = blob[:pos] + struct.pack("<I", value) + blob[pos + 4 :]
            bad = raw[: g.offset + pos] + struct.pack("<I", value) + raw[g.offset + pos + 4 :]
            path = files.write(bad)
            tracemalloc.start()
            try:
                with pytest.raises(ModelFormatError, match=r"byte \d+") as refused:
                    decode_graph(patched)
                with pytest.raises(ModelFormatError):
                    load_model(path)
            finally:
                _, peak = tracemalloc.get_traced_memory()
                tracemalloc.stop()
            assert peak < 10 * MB, (kind, value, peak)
            # Refused at the field itself (a length: at the bytes it promises), before reading
            # any item it counts: no loop over a hostile count, however cheap each turn.
            at = int(re.search(r"byte (\d+)", str(refused.value)).group(1))
            assert at in (pos, pos + 4), (kind, value, pos, str(refused.value))


def test_string_length_past_the_end(tmp_path):
    graph, weights = counts_graph()
    blob = encode_graph(graph)
    for pos, kind in graph_fields(blob):
        if kind.endswith("length"):
            value = len(blob) - pos - 4 + 1  # one byte more than remains
            with pytest.raises(ModelFormatError, match="remain"):
                decode_graph(blob[:pos] + struct.pack("<I", value) + blob[pos + 4 :])


def test_invalid_utf8_string_in_graph():
    graph, _ = counts_graph()
    blob = encode_graph(graph)
    at = blob.index(b"\x01\x00\x00\x00x") + 4  # the one-byte input name "x"
    with pytest.raises(ModelFormatError, match="UTF-8"):
        decode_graph(blob[:at] + b"\xff" + blob[at + 1 :])


def test_header_claiming_10_18_bytes(tmp_path):
    files = Files(tmp_path)
    for name in ("metadata.toml", "graph", "weights", "x-ext"):
        raw = b"~~~model 1\n~~~" + name.encode() + b" 1000000000000000000\n"
        raw += bytes(-len(raw) % 64) + b"abc"
        tracemalloc.start()
        try:
            with pytest.raises(ModelFormatError, match="claims 1000000000000000000 bytes"):
                load_model(files.write(raw))
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert peak < 1 * MB


def test_toml_section_over_the_cap_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.model"
    head = b"~~~model 1\n~~~metadata.toml %d\n" % (MAX_TOML_BYTES + 1)
    with open(path, "wb") as f:  # a sparse file: the section is zeros nobody needs to write
        f.write(head)
        f.seek(64 + MAX_TOML_BYTES + 1)
        f.write(b"~~~end 0\n" + bytes(-(64 + MAX_TOML_BYTES + 1 + 9) % 64))
    tracemalloc.start()
    try:
        with pytest.raises(ModelFormatError, match="TOML limit"):
            load_model(path)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 1 * MB


_META = b'name = "m"\n'
_X = np.arange(4, dtype=np.float32).tobytes()


def _container(meta=_META, index=None, weights=None, extra=()):
    sections = [("metadata.toml", meta)]
    if index is not None:
        sections.append(("tensors.toml", index.encode() if isinstance(index, str) else index))
    sections += list(extra)
    if weights is not None:
        sections.append(("weights", weights))
    return encode_container(sections)


def _entry(name='"t"', shape="[4]", dtype='"f32"', offset="0", size="16", more=""):
    return (f"[[tensor]]\nname = {name}\nshape = {shape}\ndtype = {dtype}\n"
            f"offset = {offset}\nsize = {size}\n{more}\n")


BAD_INDEXES = {
    "offset past the end": (_entry(offset="64"), _X, r"outside the weights section"),
    "offset far past the end": (_entry(offset=str(2**64 - 64)), _X, r"outside the weights"),
    "size past the end": (_entry(shape="[8]", size="32"), _X, r"outside the weights"),
    "size disagrees with shape": (_entry(size="12"), _X, r"size is 12 bytes, but f32\[4\] takes 16"),
    "size disagrees with dtype": (_entry(dtype='"f16"'), _X, r"takes 8 bytes"),
    "block size disagrees": (_entry(dtype='"q8_0"', shape="[32]", size="36"), _X + bytes(48),
                             r"takes 34 bytes"),
    "block format, last dim not a multiple": (_entry(dtype='"q4_0"', shape="[16]", size="9"), _X,
                                              r"not a multiple of 32"),
    "overlap": (_entry() + _entry(name='"u"', shape="[2]", size="8"), _X, r"tensors '[tu]' .* and '[tu]' .* overlap"),
    "overlap with later offset": (_entry(shape="[32]", size="128") +
                                  _entry(name='"u"', offset="64"), bytes(128), r"overlap"),
    "offset not aligned": (_entry(offset="4", shape="[2]", size="8"), _X, r"multiple of 64"),
    "duplicate name": (_entry() + _entry(offset="64"), bytes(80), r"duplicate tensor name"),
    "empty name": (_entry(name='""'), _X, r"non-empty string"),
    "name not a string": (_entry(name="5"), _X, r"non-empty string"),
    "negative dim": (_entry(shape="[-4]"), _X, r"integers in \[0, 2\^63-1\]"),
    "bool dim": (_entry(shape="[true]"), _X, r"found True"),
    "float dim": (_entry(shape="[4.0]"), _X, r"found 4.0"),
    "string dim": (_entry(shape='["4"]'), _X, r"found '4'"),
    "shape not an array": (_entry(shape="4"), _X, r"array of integers"),
    "rank over 64": (_entry(shape="[" + ", ".join(["1"] * 65) + "]", size="4"), _X, r"rank 65"),
    "dim over i64": (_entry(shape=f"[{2**63}]"), _X, r"integers in"),
    "element count overflow": (_entry(shape="[" + ", ".join([str(2**62)] * 8) + "]"), _X,
                               r"elements"),
    "element count overflow with a zero dim": (_entry(shape=f"[{2**40}, {2**40}, 0]", size="0"),
                                                _X, r"elements"),
    "unknown dtype": (_entry(dtype='"f8"'), _X, r"unknown dtype 'f8'"),
    "uppercase dtype": (_entry(dtype='"F32"'), _X, r"lowercase"),
    "dtype not a string": (_entry(dtype="0"), _X, r"lowercase"),
    "bool offset": (_entry(offset="false"), _X, r"'offset' must be a non-negative integer"),
    "bool size": (_entry(size="true", shape="[0]"), _X, r"'size' must be"),
    "negative offset": (_entry(offset="-64"), _X, r"non-negative"),
    "float size": (_entry(size="16.0"), _X, r"'size' must be"),
    "missing key": ('[[tensor]]\nname = "t"\nshape = [4]\ndtype = "f32"\noffset = 0\n', _X,
                    r"missing key\(s\) \['size'\]"),
    "unknown key": (_entry(more="extra = 1"), _X, r"unknown key\(s\) \['extra'\]"),
    "unknown top-level key": ("version = 2\n" + _entry(), _X, r"unknown top-level"),
    "tensor not an array of tables": ('tensor = "x"\n', _X, r"array of tables"),
    "entry not a table": ("tensor = [1]\n", _X, r"not a table"),
    "huge integer": (_entry(size="1" * 5000), _X, r"invalid TOML"),
    "not TOML": ("[[tensor]\n", _X, r"invalid TOML"),
    "not UTF-8": (b"[[tensor]]\nname = \"\xff\"\n", _X, r"not valid UTF-8"),
}


@pytest.mark.parametrize("case", list(BAD_INDEXES))
def test_bad_tensor_index(tmp_path, case):
    index, weights, message = BAD_INDEXES[case]
    path = Files(tmp_path).write(_container(index=index, weights=weights))
    with pytest.raises(ModelFormatError, match=message) as e:
        load_model(path)
    assert "tensors.toml" in str(e.value)


def test_bad_bool_tensor_bytes(tmp_path):
    path = Files(tmp_path).write(_container(index=_entry(dtype='"bool"', size="4"),
                                            weights=b"\x00\x01\x02\x00"))
    with pytest.raises(ModelFormatError, match="bool"):
        load_model(path)
    with load_model(path, tensors=[]) as m:  # an unmapped tensor is not read
        with pytest.raises(ModelFormatError, match="bool"):
            m.tensor("t")


_MAGIC_AND_META = b"~~~model 1\n~~~metadata.toml 0\n" + bytes(34)  # 11 + 19 + 34 = 64

BAD_CONTAINERS = {
    "empty file": (b"", r"too short"),
    "wrong magic": (b"GGUF" + bytes(60), r"not a \.model file"),
    "future version": (b"~~~model 2\n" + bytes(60), r"unsupported .model format version"),
    "magic without newline": (b"~~~model 1 " + bytes(60), r"magic"),
    "no sections": (b"~~~model 1\n", r"does not finish with the 'end' section"),
    "only end": (encode_container([]), r"'metadata.toml' is missing"),
    "end not empty": (encode_container([("metadata.toml", b""), ("end", b"x")], end=False),
                      r"'end' section must be empty"),
    "section after end": (encode_container([("metadata.toml", b""), ("end", b""), ("x-a", b"")], end=False),
                          r"out of order after 'end'|does not finish"),
    "header without newline": (b"~~~model 1\n~~~metadata.toml 0", r"byte 11: .*no newline"),
    "header too long": (b"~~~model 1\n~~~" + b"a" * 300 + b" 0\n", r"longer than 256"),
    "size with 21 digits": (b"~~~model 1\n~~~metadata.toml " + b"0" * 21 + b"\n" + bytes(64),
                            r"malformed section header"),
    "size with +": (b"~~~model 1\n~~~metadata.toml +0\n" + bytes(64), r"malformed"),
    "size with -": (b"~~~model 1\n~~~metadata.toml -0\n" + bytes(64), r"malformed"),
    "size with leading space": (b"~~~model 1\n~~~metadata.toml  0\n" + bytes(64), r"malformed"),
    "size with trailing space": (b"~~~model 1\n~~~metadata.toml 0 \n" + bytes(64), r"malformed"),
    "size in hex": (b"~~~model 1\n~~~metadata.toml 0x0\n" + bytes(64), r"malformed"),
    "no size": (b"~~~model 1\n~~~metadata.toml\n" + bytes(64), r"malformed"),
    "bad name character": (b"~~~model 1\n~~~meta/data 0\n" + bytes(64), r"malformed"),
    "non-ASCII name": ("~~~model 1\n~~~métadata 0\n".encode() + bytes(64), r"malformed"),
    "CRLF header": (b"~~~model 1\n~~~metadata.toml 0\r\n" + bytes(64), r"malformed"),
    "padding not zero": (b"~~~model 1\n~~~metadata.toml 0\n" + b"\x00" * 33 + b"\x01", r"byte 63: .*padding"),
    "padding truncated": (b"~~~model 1\n~~~metadata.toml 0\n" + bytes(10), r"padding"),
    "trailing bytes": (_MAGIC_AND_META + b"junk", r"byte 64: .*trailing bytes"),
    "trailing zero bytes": (_MAGIC_AND_META + bytes(100), r"byte 64: .*trailing bytes"),
    "trailing line": (_MAGIC_AND_META + b"junk\n", r"byte 64: malformed section header"),
    "unknown section": (encode_container([("metadata.toml", b""), ("weights2", b"")]),
                        r"unknown section name"),
    "duplicate metadata": (encode_container([("metadata.toml", b""), ("metadata.toml", b"")]),
                           r"duplicate section"),
    "duplicate extension": (encode_container([("metadata.toml", b""), ("x-a", b""),
                                              ("x-a", b"")]), r"duplicate section"),
    "metadata not first": (encode_container([("graph", encode_graph(Graph())),
                                             ("metadata.toml", b"")]), r"out of order"),
    "weights before index": (encode_container([("metadata.toml", b""), ("weights", b""),
                                               ("tensors.toml", b"")]), r"out of order"),
    "both graph forms": (encode_container([("metadata.toml", b""), ("graph", encode_graph(Graph())),
                                           ("graph.toml", b"")]), r"not both"),
    "index without weights": (encode_container([("metadata.toml", b""), ("tensors.toml", b"")]),
                              r"'weights' is missing"),
    "weights without index": (encode_container([("metadata.toml", b""), ("weights", b"")]),
                              r"'tensors.toml' is missing"),
    "metadata missing": (encode_container([("x-a", b"")]), r"'metadata.toml' is missing"),
    "metadata not TOML": (encode_container([("metadata.toml", b"a = = 1")]), r"invalid TOML"),
    "metadata not UTF-8": (encode_container([("metadata.toml", b'a = "\xc3"')]), r"UTF-8"),
    "metadata huge int": (encode_container([("metadata.toml", b"a = " + b"9" * 5000)]),
                          r"invalid TOML"),
    "graph trailing bytes": (encode_container([("metadata.toml", b""),
                                               ("graph", encode_graph(Graph()) + b"\x00")]),
                             r"trailing bytes"),
    "graph truncated": (encode_container([("metadata.toml", b""), ("graph", b"\x00\x00")]),
                        r"truncated"),
    "graph unknown op tag": (encode_container([("metadata.toml", b""),
                                               ("graph", b"\x01\x00\x00\x00" + bytes(4) + b"\xff\xff"
                                                + bytes(13))]), r"unknown op tag 65535"),
    "graph.toml invalid": (encode_container([("metadata.toml", b""), ("graph.toml", b"nodes = 3")]),
                           r"graph.toml"),
}


@pytest.mark.parametrize("case", list(BAD_CONTAINERS))
def test_bad_container(tmp_path, case):
    raw, message = BAD_CONTAINERS[case]
    with pytest.raises(ModelFormatError, match=message):
        load_model(Files(tmp_path).write(raw))


def _deep(kind: str, depth: int) -> bytes:
    return {
        "array": "a = " + "[" * depth + "]" * depth,
        "inline table": "a = " + "{b = " * depth + "1" + "}" * depth,
        "table header": "[" + ".".join(["a"] * depth) + "]\nx = 1",
        "dotted key": ".".join(["a"] * depth) + " = 1",
        "array of tables": "[[" + ".".join(["a"] * depth) + "]]",
        "spaced dotted key": " . ".join(["a"] * depth) + " = 1",
        "quoted dotted key": ".".join(['"a"'] * depth) + " = 1",
        "digit dotted key": ".".join(["0"] * depth) + " = 1",
    }[kind].encode()


@pytest.mark.parametrize("where", ["metadata.toml", "tensors.toml", "graph.toml"])
@pytest.mark.parametrize("kind", ["array", "inline table", "table header", "dotted key",
                                  "array of tables", "spaced dotted key", "quoted dotted key",
                                  "digit dotted key"])
def test_toml_nested_10000_deep(tmp_path, monkeypatch, where, kind):
    deep = _deep(kind, 10_000)
    if where == "metadata.toml":
        raw = _container(meta=deep)
    elif where == "tensors.toml":
        raw = _container(index=deep, weights=b"")
    else:
        raw = _container(extra=[("graph.toml", deep)])
    parsed = []  # the texts tomllib is given: its time is quadratic in a dotted key's parts
    loads = tomllib.loads

    def spy(text, **kw):
        parsed.append(text)
        return loads(text, **kw)

    monkeypatch.setattr(tomllib, "loads", spy)
    with pytest.raises(ModelFormatError, match="nest|dotted key|deep"):
        load_model(Files(tmp_path).write(raw))
    if kind not in ("array", "inline table"):  # (deep brackets end in tomllib's RecursionError)
        assert not any(len(text) >= len(deep) for text in parsed), "a deep dotted key was parsed, not refused before"


@pytest.mark.parametrize("kind", ["array", "inline table", "table header", "dotted key"])
def test_toml_nesting_at_the_limit_is_read_and_one_more_refused(kind):
    assert parse_toml(_deep(kind, MAX_TOML_DEPTH), "limit")  # MAX_TOML_DEPTH is allowed
    with pytest.raises(ModelFormatError, match="deeper than|more than"):
        parse_toml(_deep(kind, MAX_TOML_DEPTH + 1), "over")


def test_moderately_nested_metadata_is_fine(tmp_path):
    meta = b"v = \"" + b"1." * 500 + b"\"\n"
    meta += b"floats = [" + b", ".join([b"1.5"] * 200) + b"]  # a.b.c.d.e.f\n"
    meta += b"[" + b".".join([b"a"] * 40) + b"]\nx = 1\n"
    with load_model(Files(tmp_path).write(_container(meta=meta))) as m:
        assert m.metadata["v"].startswith("1.1.")
    with pytest.raises(ModelFormatError, match="deeper than 64"):
        load_model(Files(tmp_path).write(_container(meta=b"a = " + b"[" * 70 + b"]" * 70)))


# -- round-trip properties ---------------------------------------------------------------------
_names = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


def _wire_value(wire):
    if wire.name == "f32":
        return st.floats(width=32, allow_nan=False)
    if wire.name == "bool":
        return st.booleans()
    if wire.name == "dtype":
        return st.sampled_from(list(DType))
    if wire.name == "i64[]":
        return st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5).map(tuple)
    return st.integers(int(wire.lo), int(wire.hi))


def _payload(tag: int):
    spec = OPS_BY_TAG[tag]
    return st.fixed_dictionaries({f.name: _wire_value(f.wire) for f in spec.fields}).map(
        lambda values: spec.cls(**values)
    )


_ops = st.sampled_from(sorted(OPS_BY_TAG)).flatmap(_payload)
_u64 = st.integers(0, 2**64 - 1)
_specs = st.builds(
    lambda shape, dtype, placement: TensorSpec(tuple(shape), dtype, *(placement or (None, None))),
    st.lists(st.integers(-1, 2**63 - 1), max_size=5),
    st.sampled_from(list(DType)),
    st.none() | st.tuples(_u64, _u64),
)
_nodes = st.builds(
    Node,
    id=st.integers(0, 2**32 - 1),
    op=_ops,
    inputs=st.lists(_names, max_size=4),
    outputs=st.lists(_names, max_size=3),
    attrs=st.just({}),
    backend_hint=st.none() | st.integers(0, 255),
)
_graphs = st.builds(
    Graph,
    nodes=st.lists(_nodes, max_size=6),
    inputs=st.lists(_specs, max_size=3),
    outputs=st.lists(_names, max_size=3),
    weights=st.just({}),
)


@settings(derandomize=True, deadline=None, max_examples=200)
@given(_graphs)
def test_codec_round_trip_property(graph):
    blob = encode_graph(graph)
    decoded = decode_graph(blob)
    assert decoded == graph
    assert encode_graph(decoded) == blob
    assert graph_fields(blob)  # the documented layout accounts for every byte


@settings(derandomize=True, deadline=None, max_examples=20)
@given(st.data())
def test_every_op_payload_round_trips(data):
    for tag in sorted(OPS_BY_TAG):
        op = data.draw(_payload(tag), label=OPS_BY_TAG[tag].name)
        graph = Graph([Node(tag, op, ["a"], ["b"])], [], ["b"], {})
        blob = encode_graph(graph)
        assert decode_graph(blob) == graph and encode_graph(decode_graph(blob)) == blob


@st.composite
def _weights(draw):
    """Up to 4 tensors of any dtype (block types as QuantizedArray of random blocks)."""
    names = draw(st.lists(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1,
                                  max_size=10), max_size=4, unique=True))
    out = {}
    for name in names:
        dtype = draw(st.sampled_from(list(DType)))
        shape = draw(st.lists(st.integers(0, 4), min_size=dtype.is_quantized, max_size=3))
        if dtype.is_quantized:
            shape[-1] *= dtype.block_size
        n = dtype.nbytes(shape)
        raw = draw(st.binary(min_size=n, max_size=n))
        if dtype is DType.BOOL:
            raw = bytes(b & 1 for b in raw)
        if dtype.is_quantized:
            rows = (*shape[:-1], shape[-1] // dtype.block_size * dtype.block_bytes)
            out[name] = QuantizedArray(np.frombuffer(raw, np.uint8).reshape(rows), dtype, tuple(shape))
        else:
            out[name] = np.frombuffer(raw, dtype.numpy).reshape(shape)
    return out


@settings(derandomize=True, deadline=None, max_examples=100,
          suppress_health_check=[HealthCheck.too_slow])
@given(_graphs, _weights())
def test_save_load_round_trip_property(graph, weights):
    with tempfile.TemporaryDirectory(dir=_SHM) as d:
        path = Path(d) / "p.model"
        save_model(path, graph, weights, {"name": "property"}).close()
        with load_model(path, validate=False) as m:
            assert m.graph == Graph(graph.nodes, graph.inputs, graph.outputs, m.index)
            assert encode_graph(m.graph) == encode_graph(graph)
            assert list(m.index) == list(weights)
            for name, arr in weights.items():
                got = m.weights[name]
                assert type(got) is type(arr) and got.dtype == arr.dtype and got.shape == arr.shape
                if isinstance(arr, QuantizedArray):
                    got, arr = got.data, arr.data
                assert got.tobytes() == arr.tobytes()
            check_invariants(m, path.read_bytes())


def test_graph_toml_section_over_the_cap_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.model"
    raw = encode_container([("metadata.toml", b"")], end=False)
    hdr = b"~~~graph.toml %d\n" % (MAX_TOML_BYTES + 1)
    start = len(raw) + len(hdr)
    with open(path, "wb") as f:
        f.write(raw + hdr)
        data_end = -(-start // 64) * 64 + MAX_TOML_BYTES + 1
        f.seek(data_end)
        f.write(b"~~~end 0\n" + bytes(-(data_end + 9) % 64))
    tracemalloc.start()
    try:
        with pytest.raises(ModelFormatError, match="graph.toml.*TOML limit"):
            load_model(path)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 1 * MB


def test_toml_depth_limit_is_exactly_64(tmp_path):
    files = Files(tmp_path)
    ok = b"y = " + b"[" * 64 + b"]" * 64 + b"\n[" + b".".join([b"k"] * 64) + b"]\nx = 1\n"
    with load_model(files.write(_container(meta=ok))) as m:
        assert "k" in m.metadata
    for bad in (b"[" + b".".join([b"k"] * 65) + b"]\n", b"y = " + b"[" * 65 + b"]" * 65 + b"\n",
                b"[" + b".".join([b"k"] * 64) + b"]\ny = [[]]\n"):
        with pytest.raises(ModelFormatError, match="64"):
            load_model(files.write(_container(meta=bad)))

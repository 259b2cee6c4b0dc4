"""Transport frames: round trips of every wire dtype, and hostile frames refused before anything
is allocated, with only TransportError escaping."""

import math
import tracemalloc

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_runtime.errors import TransportError
from dist_runtime.transport import MAX_MESSAGE_BYTES, WIRE_DTYPES, decode_message, encode_message


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
def test_round_trip_every_wire_dtype(name):
    dt = WIRE_DTYPES[name].numpy
    for shape in [(), (0,), (3,), (2, 0, 4), (2, 3, 4)]:
        a = (np.arange(math.prod(shape)) % 7).astype(dt).reshape(shape)
        t, meta = decode_message(encode_message({"x": a}, {"session": "s", "pos": 3}))
        assert t["x"].dtype == a.dtype and t["x"].shape == a.shape
        assert t["x"].tobytes() == a.tobytes() and meta == {"session": "s", "pos": 3}


def test_non_contiguous_and_big_endian_inputs_are_sent_as_little_endian_c_order():
    a = np.arange(12, dtype=">f4").reshape(3, 4).T
    t, _ = decode_message(encode_message({"a": a}))
    np.testing.assert_array_equal(t["a"], a)
    assert t["a"].dtype == np.dtype("<f4")


def frame(**kw):
    f = {"dtype": "f32", "shape": [2], "data": b"\0" * 8}
    f.update(kw)
    return msgpack.packb({"v": 1, "meta": {}, "tensors": {"x": f}}, use_bin_type=True)


HOSTILE = {
    "object dtype": (frame(dtype="O"), "dtype 'O' is not one of"),
    "numpy string dtype": (frame(dtype="<f4"), "is not one of"),
    "structured dtype": (frame(dtype="[('a','<f4')]"), "is not one of"),
    "block dtype": (frame(dtype="q8_0"), "is not one of"),
    "2**40 elements": (frame(shape=[2**40], data=b""), r"needs 4,398,046,511,104 bytes, the frame has 0"),
    "bytes disagree": (frame(shape=[3]), r"needs 12 bytes, the frame has 8"),
    "negative dim": (frame(shape=[-1], data=b""), "non-negative integers"),
    "bool dim": (frame(shape=[True, 2]), "non-negative integers"),
    "float dim": (frame(shape=[2.0]), "non-negative integers"),
    "rank 33": (frame(shape=[1] * 33, data=b"\0" * 4), "at most 32 dims"),
    "data not bin": (frame(data="abcdefgh"), "must be msgpack bin"),
    "extra key": (frame(extra=1), "exactly dtype, shape and data"),
    "not a map": (msgpack.packb([1, 2, 3]), "not a version-1 message"),
    "wrong version": (msgpack.packb({"v": 2, "meta": {}, "tensors": {}}), "not a version-1 message"),
    "extension type": (msgpack.packb({"v": 1, "meta": msgpack.ExtType(5, b"x"), "tensors": {}}), "max_ext_len|extension"),
    "deep nesting": (b"\x91" * 200_000 + b"\xc0", "malformed msgpack"),
    "truncated": (frame()[:-3], "malformed msgpack"),
    "trailing bytes": (frame() + b"\x00", "malformed msgpack"),
    "invalid byte": (b"\xc1", "malformed msgpack"),
    "not bytes": ("a string", "is bytes, not str"),
    "huge map header": (b"\xdf\xff\xff\xff\xff", "malformed msgpack"),
    "huge bin header": (b"\xc6\xff\xff\xff\xff", "malformed msgpack"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_frames(case):
    data, message = HOSTILE[case]
    tracemalloc.start()
    try:
        with pytest.raises(TransportError, match=message):
            decode_message(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20 + 10 * len(data), f"{case}: {peak} bytes allocated"


def test_101_mib_message_is_refused_unread():
    big = b"\x00" * (101 * 2**20)
    with pytest.raises(TransportError, match="exceeds the limit"):
        decode_message(big)
    with pytest.raises(TransportError, match="exceeds the limit"):
        encode_message({"x": np.zeros(MAX_MESSAGE_BYTES // 4 + 16, np.float32)})


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_only_raise_transport_error(data):
    try:
        decode_message(data)
    except TransportError:
        pass


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.data())
def test_byte_flips_of_valid_messages_only_raise_transport_error(data):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    msg = bytearray(encode_message({"h": a, "b": np.ones(2, ml_dtypes.bfloat16)}, {"pos": 1}))
    i = data.draw(st.integers(0, len(msg) - 1))
    msg[i] = data.draw(st.integers(0, 255))
    try:
        tensors, _ = decode_message(bytes(msg))
    except TransportError:
        return
    for t in tensors.values():  # whatever decoded is a well-formed array
        assert t.nbytes == math.prod(t.shape) * t.itemsize

"""The canonical bytes of a hand-built decoder-layer graph, pinned, and of a graph whose payloads
hold ``i64[]`` lists (Reshape, Permute, Split).

The expected bytes are spelled out field by field from the seed's layout (u32 counts, strings as
u32 length + UTF-8, ``u32 id, u16 op_tag, payload, inputs, outputs, u8 has_backend_hint``, tensor
specs as ``u32 rank, i64[rank], u8 dtype, u8 has_offset``), using only ``int.to_bytes`` and IEEE
f32 constants written out in hex -- not the encoder under test.  A SHA-256 of the result is pinned
as well, so that a change to this spelled-out form is noticed too.
"""

import hashlib

from dist_runtime.dtypes import DType
from dist_runtime.ir.codec import decode_graph, encode_graph
from dist_runtime.ir.graph import Graph, Node, TensorSpec
from dist_runtime.ir.ops import (Add, KvCache, Matmul, Permute, Reshape, RmsNorm, Rope, Sample,
                                 Sdpa, Split, SwiGlu, TokenEmbed)


def u8(v): return v.to_bytes(1, "little")
def u16(v): return v.to_bytes(2, "little")
def u32(v): return v.to_bytes(4, "little")
def i64(v): return v.to_bytes(8, "little", signed=True)
def s(text): return u32(len(text.encode())) + text.encode()
def names(*xs): return u32(len(xs)) + b"".join(s(x) for x in xs)


# IEEE-754 single precision, little-endian, worked out by hand:
F32_1E_5 = bytes.fromhex("acc52737")      # 1e-5  -> 0x3727C5AC
F32_10000 = bytes.fromhex("00401c46")     # 10000 -> 0x461C4000
F32_1 = bytes.fromhex("0000803f")         # 1.0   -> 0x3F800000
F32_0_5 = bytes.fromhex("0000003f")       # 0.5   -> 0x3F000000

W = "model.layers.0."
NODES = [
    # (id, op, inputs, outputs, hint, hand-written payload bytes)
    (0, TokenEmbed(), ["tokens", "model.embed_tokens.weight"], ["h0"], None, b""),
    (1, RmsNorm(eps=1e-5), ["h0", W + "input_layernorm.weight"], ["x0"], None, F32_1E_5),
    (2, Matmul(), ["x0", W + "self_attn.q_proj.weight"], ["q"], None, u8(1)),
    (3, Matmul(), ["x0", W + "self_attn.k_proj.weight"], ["k"], None, u8(1)),
    (4, Matmul(), ["x0", W + "self_attn.v_proj.weight"], ["v"], 0, u8(1)),
    (5, Rope(head_dim=16, rope_dim=16, base=10000.0), ["q", "pos"], ["q_rot"], None,
     u32(16) + u32(16) + F32_10000),
    (6, Rope(head_dim=16, rope_dim=8, base=10000.0), ["k", "pos"], ["k_rot"], None,
     u32(16) + u32(8) + F32_10000),
    (7, KvCache(max_seq=2048), ["k_rot", "v"], ["k_all", "v_all"], None, u32(2048)),
    (8, Sdpa(num_heads=4, kv_heads=2, head_dim=16, causal=True), ["q_rot", "k_all", "v_all"],
     ["attn"], None, u32(4) + u32(2) + u32(16) + u8(1)),
    (9, Matmul(), ["attn", W + "self_attn.o_proj.weight"], ["o"], None, u8(1)),
    (10, Add(), ["h0", "o"], ["h1"], None, b""),
    (11, RmsNorm(eps=1e-5), ["h1", W + "post_attention_layernorm.weight"], ["x1"], None, F32_1E_5),
    (12, Matmul(), ["x1", W + "mlp.gate_proj.weight"], ["gate"], None, u8(1)),
    (13, Matmul(), ["x1", W + "mlp.up_proj.weight"], ["up"], None, u8(1)),
    (14, SwiGlu(), ["gate", "up"], ["act"], None, b""),
    (15, Matmul(), ["act", W + "mlp.down_proj.weight"], ["down"], None, u8(1)),
    (16, Add(), ["h1", "down"], ["h2"], None, b""),
    (17, RmsNorm(eps=1e-5), ["h2", "model.norm.weight"], ["xf"], None, F32_1E_5),
    (18, Matmul(), ["xf", "lm_head.weight"], ["logits"], None, u8(1)),
    (19, Sample(method=3, temperature=0.5, p=1.0, k=0), ["logits"], ["token"], 3,
     u8(3) + F32_0_5 + F32_1 + u32(0)),
]
TAGS = {"TokenEmbed": 120, "RmsNorm": 40, "Matmul": 0, "Rope": 26, "KvCache": 23, "Sdpa": 20,
        "Add": 1, "SwiGlu": 63, "Sample": 144}


def expected_bytes() -> bytes:
    out = u32(len(NODES))
    for node_id, op, inputs, outputs, hint, payload in NODES:
        out += u32(node_id) + u16(TAGS[type(op).__name__]) + payload
        out += names(*inputs) + names(*outputs)
        out += u8(0) if hint is None else u8(1) + u8(hint)
    # one graph input: "tokens", i32[-1], no offset
    out += u32(1) + u32(1) + i64(-1) + u8(26) + u8(0)
    out += names("logits", "token")
    return out


def build_graph() -> Graph:
    nodes = [Node(i, op, list(ins), list(outs), {}, hint) for i, op, ins, outs, hint, _ in NODES]
    return Graph(nodes, [TensorSpec((-1,), DType.I32)], ["logits", "token"], {})


def test_encoder_produces_the_hand_written_bytes():
    assert encode_graph(build_graph()) == expected_bytes()


def test_decoder_reads_the_hand_written_bytes():
    g = decode_graph(expected_bytes())
    assert g == build_graph()
    assert g.nodes[19].op == Sample(method=3, temperature=0.5, p=1.0, k=0)
    assert g.nodes[4].backend_hint == 0 and g.nodes[3].backend_hint is None
    assert encode_graph(g) == expected_bytes()


def test_hand_written_bytes_are_pinned():
    data = expected_bytes()
    assert len(data) == PINNED_LENGTH
    assert hashlib.sha256(data).hexdigest() == PINNED_SHA256


PINNED_LENGTH = 1204
PINNED_SHA256 = "16c97aaecfc1ddbe47561ba8e5d643d7ec2d85ed1afa3fb29a5eeec6ee5bf599"


# ---- i64[] payload fields (Reshape, Permute, Split): docs/format.md lays one out as a u32 count
# `n`, then `n` i64, little-endian like everything else.  Items are chosen so that a byte-order
# slip cannot go unseen: -1 and 0 are symmetric in byte order, 0x0102030405060708 and 16 are not.

def i32(v): return v.to_bytes(4, "little", signed=True)
def i64s(*xs): return u32(len(xs)) + b"".join(i64(x) for x in xs)


LIST_NODES = [
    # (id, op, inputs, outputs, hand-written payload bytes)
    (0, Reshape(shape=(0, -1, 4, 16)), ["x"], ["x4"], i64s(0, -1, 4, 16)),
    (1, Permute(perm=(0, 2, 1, 3)), ["x4"], ["xp"], i64s(0, 2, 1, 3)),
    (2, Split(dim=-1, sizes=(8, 0x0102030405060708)), ["xp"], ["lo", "hi"],
     i32(-1) + i64s(8, 0x0102030405060708)),
    (3, Reshape(shape=()), ["lo"], ["scalar"], i64s()),
]
LIST_TAGS = {"Reshape": 6, "Permute": 7, "Split": 9}


def list_graph_bytes() -> bytes:
    out = u32(len(LIST_NODES))
    for node_id, op, inputs, outputs, payload in LIST_NODES:
        out += u32(node_id) + u16(LIST_TAGS[type(op).__name__]) + payload
        out += names(*inputs) + names(*outputs) + u8(0)
    # one graph input: "x", f32[-1,64], no offset
    out += u32(1) + u32(2) + i64(-1) + i64(64) + u8(0) + u8(0)
    out += names("scalar", "hi")
    return out


def build_list_graph() -> Graph:
    nodes = [Node(i, op, list(ins), list(outs), {}, None) for i, op, ins, outs, _ in LIST_NODES]
    return Graph(nodes, [TensorSpec((-1, 64), DType.F32)], ["scalar", "hi"], {})


def test_i64_list_payloads_match_the_documented_layout():
    # the Split payload byte for byte: i32 dim, u32 count, then each i64 least significant first
    assert list_graph_bytes().count(bytes.fromhex("ffffffff" "02000000"
                                                  "0800000000000000" "0807060504030201")) == 1
    assert encode_graph(build_list_graph()) == list_graph_bytes()


def test_i64_list_payloads_decode_from_the_hand_written_bytes():
    g = decode_graph(list_graph_bytes())
    assert g == build_list_graph()
    assert g.nodes[2].op.sizes == (8, 0x0102030405060708)
    assert g.nodes[0].op.shape == (0, -1, 4, 16) and g.nodes[3].op.shape == ()

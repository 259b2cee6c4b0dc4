"""Small example models built in code: the README's main job and the tests use them.

``tiny_llama`` is a Llama-architecture decoder (RmsNorm, grouped-query attention with rotate-half
Rope and a KV cache, SwiGLU MLP, untied lm_head) with seeded random weights and Hugging Face
weight names.  It is small enough to build in milliseconds, but has every structural feature of
the real thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import DType
from .ir.graph import POS, Graph, Node, TensorSpec
from .ir.ops import Add, KvCache, Matmul, RmsNorm, Rope, Sample, Sdpa, SwiGlu, TokenEmbed


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    rope_base: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class _Builder:
    """Appends nodes with consecutive ids; keeps graph construction to one line per op."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []

    def __call__(self, op, inputs: list[str], outputs: list[str] | str) -> str:
        outs = [outputs] if isinstance(outputs, str) else outputs
        self.nodes.append(Node(len(self.nodes), op, list(inputs), outs))
        return outs[0]


def llama_graph(cfg: LlamaConfig) -> Graph:
    """The decoder graph; weights are described by name only (the container supplies specs)."""
    b = _Builder()
    kv_dim = cfg.kv_heads * cfg.head_dim
    h = b(TokenEmbed(), ["tokens", "model.embed_tokens.weight"], "h_embed")
    for i in range(cfg.layers):
        w, p = f"model.layers.{i}.", f"l{i}_"
        x = b(RmsNorm(eps=cfg.eps), [h, w + "input_layernorm.weight"], p + "attn_in")
        q = b(Matmul(), [x, w + "self_attn.q_proj.weight"], p + "q")
        k = b(Matmul(), [x, w + "self_attn.k_proj.weight"], p + "k")
        v = b(Matmul(), [x, w + "self_attn.v_proj.weight"], p + "v")
        rope = Rope(head_dim=cfg.head_dim, rope_dim=cfg.head_dim, base=cfg.rope_base)
        q = b(rope, [q, POS], p + "q_rot")
        k = b(rope, [k, POS], p + "k_rot")
        k_all = b(KvCache(), [k, v], [p + "k_all", p + "v_all"])
        attn = b(Sdpa(num_heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, causal=True),
                 [q, k_all, p + "v_all"], p + "attn")
        o = b(Matmul(), [attn, w + "self_attn.o_proj.weight"], p + "attn_out")
        h = b(Add(), [h, o], p + "resid_attn")
        x = b(RmsNorm(eps=cfg.eps), [h, w + "post_attention_layernorm.weight"], p + "mlp_in")
        gate = b(Matmul(), [x, w + "mlp.gate_proj.weight"], p + "gate")
        up = b(Matmul(), [x, w + "mlp.up_proj.weight"], p + "up")
        act = b(SwiGlu(), [gate, up], p + "act")
        down = b(Matmul(), [act, w + "mlp.down_proj.weight"], p + "down")
        h = b(Add(), [h, down], p + "resid_mlp")
    assert kv_dim > 0
    x = b(RmsNorm(eps=cfg.eps), [h, "model.norm.weight"], "final_norm")
    b(Matmul(), [x, "lm_head.weight"], "logits")
    b(Sample(), ["logits"], "next_token")
    return Graph(b.nodes, [TensorSpec((-1,), DType.I32)], ["logits", "next_token"], {})


def llama_weights(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random f32 weights with Hugging Face names and [out, in] matmul layout."""
    rng = np.random.default_rng(seed)
    kv_dim = cfg.kv_heads * cfg.head_dim

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    weights = {"model.embed_tokens.weight": mat(cfg.vocab, cfg.hidden)}
    for i in range(cfg.layers):
        w = f"model.layers.{i}."
        weights |= {
            w + "input_layernorm.weight": norm(cfg.hidden),
            w + "self_attn.q_proj.weight": mat(cfg.hidden, cfg.hidden),
            w + "self_attn.k_proj.weight": mat(kv_dim, cfg.hidden),
            w + "self_attn.v_proj.weight": mat(kv_dim, cfg.hidden),
            w + "self_attn.o_proj.weight": mat(cfg.hidden, cfg.hidden),
            w + "post_attention_layernorm.weight": norm(cfg.hidden),
            w + "mlp.gate_proj.weight": mat(cfg.ffn, cfg.hidden),
            w + "mlp.up_proj.weight": mat(cfg.ffn, cfg.hidden),
            w + "mlp.down_proj.weight": mat(cfg.hidden, cfg.ffn),
        }
    weights["model.norm.weight"] = norm(cfg.hidden)
    weights["lm_head.weight"] = mat(cfg.vocab, cfg.hidden)
    return weights


def llama_metadata(cfg: LlamaConfig) -> dict:
    return {
        "name": "tiny-llama (random weights)",
        "architecture": "llama",
        "created_by": "dist-runtime example",
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
    }

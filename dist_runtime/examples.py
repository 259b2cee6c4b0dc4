"""Small example models built in code: the README's main job and the tests use them.

``tiny_llama`` is a Llama-architecture decoder (RmsNorm, grouped-query attention with rotate-half
Rope and a KV cache, SwiGLU MLP, untied lm_head) with seeded random weights and Hugging Face
weight names.  It is small enough to build in milliseconds, but has every structural feature of
the real thing.  The graph is the Hugging Face importer's Llama graph
(:func:`dist_runtime.importers.hf.llama.decoder_graph`) with a greedy ``Sample`` -> ``next_token`` at
the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .importers.hf.llama import DecoderConfig, decoder_graph, random_weights
from .ir.graph import Graph


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

    def decoder(self) -> DecoderConfig:
        """This config as the importer's architecture-neutral description."""
        return DecoderConfig(vocab=self.vocab, hidden=self.hidden, layers=self.layers, heads=self.heads,
                             kv_heads=self.kv_heads, head_dim=self.head_dim, ffn=self.ffn,
                             rope_base=self.rope_base, eps=self.eps, sample=True)


def llama_graph(cfg: LlamaConfig) -> Graph:
    """The decoder graph; weights are described by name only (the container supplies specs)."""
    return decoder_graph(cfg.decoder())


def llama_weights(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random f32 weights with Hugging Face names and [out, in] matmul layout."""
    return random_weights(cfg.decoder(), seed)


def llama_metadata(cfg: LlamaConfig) -> dict:
    return {
        "name": "tiny-llama (random weights)",
        "architecture": "llama",
        "created_by": "dist-runtime example",
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
    }

"""Hugging Face importer for GPT-2 (``model_type`` "gpt2", ``GPT2LMHeadModel``).

The graph has the inputs and outputs of ``llama.decoder_graph`` -- ``tokens`` ``i32[T]`` in,
``logits`` ``f32[T, vocab]`` out, the injected ``pos`` for positions -- so ``dist-runtime
generate`` and the pipeline run it as they run a Llama.  Per layer (pre-norm)::

    h = wte[tokens] + wpe[pos .. pos+T-1]          PosEmbed: learned positions follow the KV cache
    x = LayerNorm(h)                               ln_1
    q, k, v = Split(x @ Wqkv^T + bqkv)             c_attn, fused
    a = Sdpa(q, KvCache(k, v), causal) @ Wo^T + bo
    h = h + a;  h = h + c_proj(Gelu_tanh(c_fc(LayerNorm(h))))
    logits = LayerNorm(h) @ wte^T                  ln_f, tied lm_head

GPT-2 stores its projections as ``Conv1D`` weights ``[in, out]``; they are transposed at import to
``[out, in]``, so they are ordinary ``Matmul(transpose_b)`` weights that ``--dtype`` quantizes.  The
fused ``c_attn`` stays one matrix (one matmul per layer, not three) and a Split separates q, k, v.
Weight names are Hugging Face's relative to ``GPT2Model`` (``transformer.`` dropped); an untied
``lm_head.weight`` keeps its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from ...dtypes import DType
from ...ir.builder import GraphBuilder
from ...ir.graph import POS, Graph, TensorSpec
from ...ir.ops import Add, Gelu, KvCache, LayerNorm, PosEmbed, Sdpa, Split, TokenEmbed
from ..common import Imported
from .common import HFImportError, chat_template_of, read_config, read_weights, token_ids

_GELU = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True, "gelu": False}
#: config keys whose value changes the computation, and the one value this importer implements.
_FIXED = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}


@dataclass(frozen=True)
class GPT2Config:
    vocab: int
    hidden: int
    layers: int
    heads: int
    ffn: int
    context_length: int  # n_positions: rows of the position table
    eps: float = 1e-5
    gelu_tanh: bool = True
    tied: bool = True

    def __post_init__(self) -> None:
        dims = {k: getattr(self, k) for k in ("vocab", "hidden", "layers", "heads", "ffn", "context_length")}
        bad = {k: v for k, v in dims.items() if not (isinstance(v, int) and v >= 1)}
        if bad:
            raise HFImportError(f"model dimensions must be positive integers, got {bad}")
        if self.hidden % self.heads:
            raise HFImportError(f"n_embd {self.hidden} is not a multiple of n_head {self.heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def gpt2_config(config: Mapping) -> GPT2Config:
    """The :class:`GPT2Config` of a GPT-2 ``config.json`` (as a dict)."""
    if config.get("model_type") != "gpt2":
        raise HFImportError(f"model_type {config.get('model_type')!r} is not GPT-2 (expected 'gpt2')")
    for key, value in _FIXED.items():
        if config.get(key, value) != value:
            raise HFImportError(f"config.json {key}={config[key]!r} is not supported (only {value!r})")
    act = config.get("activation_function", "gelu_new")
    if act not in _GELU:
        raise HFImportError(f"config.json activation_function={act!r} is not supported; supported: {sorted(_GELU)}")

    def need(key: str):
        if config.get(key) is None:
            raise HFImportError(f"config.json lacks {key!r}, which GPT-2 needs")
        return config[key]

    hidden = need("n_embd")
    return GPT2Config(vocab=need("vocab_size"), hidden=hidden, layers=need("n_layer"), heads=need("n_head"),
                      ffn=config.get("n_inner") or 4 * hidden, context_length=need("n_positions"),
                      eps=float(config.get("layer_norm_epsilon", 1e-5)), gelu_tanh=_GELU[act],
                      tied=bool(config.get("tie_word_embeddings", True)))


# -- the graph -------------------------------------------------------------------------------------
def _layer_norm(b: GraphBuilder, cfg: GPT2Config, x: str, prefix: str, out: str) -> str:
    weight, bias = b.weight(prefix + ".weight", cfg.hidden), b.weight(prefix + ".bias", cfg.hidden)
    return b.emit(LayerNorm(eps=cfg.eps), [x, weight, bias], out)


def _build(cfg: GPT2Config) -> GraphBuilder:
    b, hd = GraphBuilder(), cfg.hidden
    h = b.emit(TokenEmbed(), ["tokens", b.weight("wte.weight", cfg.vocab, hd)], "h_embed")
    positions = b.emit(PosEmbed(), [h, b.weight("wpe.weight", cfg.context_length, hd), POS], "positions")
    h = b.emit(Add(), [h, positions], "h_pos")
    attention = Sdpa(num_heads=cfg.heads, kv_heads=cfg.heads, head_dim=cfg.head_dim, causal=True)
    for i in range(cfg.layers):
        w, p = f"h.{i}.", f"l{i}_"
        x = _layer_norm(b, cfg, h, w + "ln_1", p + "attn_in")
        qkv = b.linear(x, w + "attn.c_attn", 3 * hd, hd, True, p + "qkv")
        b.emit(Split(dim=-1, sizes=(hd, hd, hd)), [qkv], [p + "q", p + "k", p + "v"])
        b.emit(KvCache(), [p + "k", p + "v"], [p + "k_all", p + "v_all"])
        a = b.emit(attention, [p + "q", p + "k_all", p + "v_all"], p + "attn")
        h = b.emit(Add(), [h, b.linear(a, w + "attn.c_proj", hd, hd, True, p + "attn_out")], p + "resid_attn")
        x = _layer_norm(b, cfg, h, w + "ln_2", p + "mlp_in")
        fc = b.linear(x, w + "mlp.c_fc", cfg.ffn, hd, True, p + "fc")
        m = b.emit(Gelu(approximate=cfg.gelu_tanh), [fc], p + "act")
        h = b.emit(Add(), [h, b.linear(m, w + "mlp.c_proj", hd, cfg.ffn, True, p + "down")], p + "resid_mlp")
    x = _layer_norm(b, cfg, h, "ln_f", "final_norm")
    b.linear(x, "lm_head", cfg.vocab, hd, False, "logits", "wte.weight" if cfg.tied else None)
    return b


def gpt2_graph(cfg: GPT2Config) -> Graph:
    """Input ``tokens`` (i32[-1]), output ``logits``; weights are named only."""
    return Graph(_build(cfg).nodes, [TensorSpec((-1,), DType.I32)], ["logits"], {})


def weight_shapes(cfg: GPT2Config) -> dict[str, tuple[int, ...]]:
    return _build(cfg).weights


def conv1d_weights(cfg: GPT2Config) -> frozenset[str]:
    """The weights GPT-2 stores ``[in, out]`` (its Conv1D layers)."""
    return frozenset(f"h.{i}.{m}.weight" for i in range(cfg.layers)
                     for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))


# -- conversion ------------------------------------------------------------------------------------
def load(hf_dir: str | Path, dtype: str = "f32", *, progress: bool = False, deferred: bool = False) -> Imported:
    """Read a GPT-2 model directory and convert it (the entry point of the ``hf`` package's dispatch)."""
    hf_dir = Path(hf_dir)
    config = read_config(hf_dir)
    cfg = gpt2_config(config)
    shapes = weight_shapes(cfg)
    graph, weights, source_dtypes, ignored = read_weights(
        hf_dir, gpt2_graph(cfg), shapes, dtype, prefixes=("transformer.", ""), made={},
        transposed=conv1d_weights(cfg), unprefixed=frozenset({"lm_head.weight"}), what="GPT2LMHeadModel",
        progress=progress, deferred=deferred)
    metadata = {
        "name": config.get("_name_or_path") or hf_dir.resolve().name,
        "architecture": "gpt2",
        "created_by": "dist-runtime convert",
        "source": {"format": "huggingface", "class": "GPT2LMHeadModel",
                   "dtypes": dict(source_dtypes), "directory": hf_dir.resolve().name},
        "dtype": dtype,
        "config": asdict(cfg),
        **token_ids(hf_dir, config),
        **chat_template_of(hf_dir),
    }
    tokenizer = hf_dir / "tokenizer.json"
    return Imported(graph, weights, metadata, "gpt2", source_dtypes, ignored,
                    tokenizer if tokenizer.is_file() else None, cfg)

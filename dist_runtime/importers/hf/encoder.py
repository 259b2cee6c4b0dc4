"""Hugging Face importer for BERT-family encoders (``model_type`` "bert": BERT, MiniLM).

Graph inputs, all ``i32[B, T]``, in this order: ``input_ids``; ``attention_mask`` (1 = token,
0 = padding); ``token_type_ids`` (always an input: pass zeros for single sentences, which is what
the Hugging Face model assumes when it is omitted).  Per layer (post-norm, BERT style)::

    h = LayerNorm(word[input_ids] + position[0..T-1] + token_type[token_type_ids])
    a = Sdpa(h Wq^T + bq, h Wk^T + bk, h Wv^T + bv, mask)      bidirectional, padding masked
    h = LayerNorm(h + a Wo^T + bo)
    h = LayerNorm(h + Gelu_erf(h Wi^T + bi) Wd^T + bd)

The additive mask ``[B, 1, 1, T]`` is a row lookup (TokenEmbed) of ``attention_mask`` in the
2-row table ``[[finfo(f32).min], [0]]``: exactly Hugging Face's ``(1 - mask) * finfo.min``.
Output ``last_hidden_state`` ``f32[B, T, H]`` (rows of padding positions are meaningless, as in
Hugging Face).  The encoder is stateless: no KV cache, positions always start at 0.

When the directory is a sentence-transformers model (``modules.json``: Transformer ->
Pooling(mean) [-> Normalize]), a second output ``sentence_embedding`` ``f32[B, H]`` is what
``SentenceTransformer.encode`` returns; the ``max_seq_length`` of its ``sentence_bert_config.json``
(where ``SentenceTransformer`` truncates, whatever its tokenizer.json says) goes into the metadata
and the converted tokenizer.  There is no reduce op, so the masked mean is two matmuls,
``(m @ h) / (m @ m^T)`` with ``m`` the 0/1 mask as ``[B, 1, T]``; and the L2 norm is
RmsNorm with weight ``1/sqrt(H)``, since ``x / sqrt(mean(x^2) + eps) / sqrt(H) = x / sqrt(|x|^2 +
H eps)``, with ``H eps = 1e-24``: torch's ``normalize`` floor ``max(|x|, 1e-12)``, squared.

Weight names are Hugging Face's relative to ``BertModel`` (a ``bert.`` prefix, as
``BertForMaskedLM`` and others save, is dropped); matmul weights stay ``[out, in]``.  The importer
makes three small tensors no checkpoint holds: the two mask tables and the normalisation scale.

Running a converted model on sentences (tokenize, pad, run) is ``dist_runtime.embed``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ...dtypes import DType
from ...ir.builder import GraphBuilder
from ...ir.graph import Graph, TensorSpec
from ...ir.ops import Add, Div, Gelu, LayerNorm, Matmul, PosEmbed, Reshape, RmsNorm, Sdpa, TokenEmbed
from ..common import Imported
from .common import HFImportError, read_config, read_weights

#: graph inputs, in graph order.
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
MASK_ADDITIVE, MASK_KEEP, NORMALIZE_SCALE = "attention_mask.additive", "attention_mask.keep", "normalize.scale"
_NORMALIZE_FLOOR = 1e-24  # F.normalize's eps (1e-12), squared: what the RmsNorm eps adds to |x|^2


@dataclass(frozen=True)
class EncoderConfig:
    """A BERT-style encoder, as the graph builder needs it."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    ffn: int
    positions: int  # max_position_embeddings: the longest input
    type_vocab: int
    eps: float = 1e-12
    pooling: str = ""  # "mean": add the sentence_embedding output; "" = last_hidden_state only
    normalize: bool = False  # L2-normalise the sentence embedding

    def __post_init__(self) -> None:
        dims = {k: getattr(self, k) for k in ("vocab", "hidden", "layers", "heads", "ffn", "positions", "type_vocab")}
        bad = {k: v for k, v in dims.items() if not (isinstance(v, int) and v >= 1)}
        if bad:
            raise HFImportError(f"model dimensions must be positive integers, got {bad}")
        if self.hidden % self.heads:
            raise HFImportError(f"hidden_size {self.hidden} is not a multiple of num_attention_heads {self.heads}")
        if self.pooling not in ("", "mean") or (self.normalize and not self.pooling):
            raise HFImportError(f"pooling {self.pooling!r} (normalize={self.normalize}) is not supported")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# -- config.json and modules.json ------------------------------------------------------------------
#: config keys whose value changes the computation, and the one value this importer implements.
_FIXED = {"position_embedding_type": "absolute", "is_decoder": False, "add_cross_attention": False}


def encoder_config(config: Mapping, pooling: str = "", normalize: bool = False) -> EncoderConfig:
    """The :class:`EncoderConfig` of a BERT ``config.json`` (as a dict)."""
    if config.get("model_type") != "bert":
        raise HFImportError(f"model_type {config.get('model_type')!r} is not a BERT encoder (expected 'bert')")
    for key, value in _FIXED.items():
        if config.get(key, value) not in (value, None):
            raise HFImportError(f"config.json {key}={config[key]!r} is not supported (only {value!r})")
    act = config.get("hidden_act", "gelu")
    if act != "gelu":
        raise HFImportError(f"config.json hidden_act={act!r} is not supported (only 'gelu', the exact erf GELU)")

    def need(key: str):
        if config.get(key) is None:
            raise HFImportError(f"config.json lacks {key!r}, which a BERT encoder needs")
        return config[key]

    return EncoderConfig(vocab=need("vocab_size"), hidden=need("hidden_size"), layers=need("num_hidden_layers"),
                         heads=need("num_attention_heads"), ffn=need("intermediate_size"),
                         positions=need("max_position_embeddings"), type_vocab=config.get("type_vocab_size", 2),
                         eps=float(config.get("layer_norm_eps", 1e-12)), pooling=pooling, normalize=normalize)


def sentence_transformers_head(hf_dir: str | Path) -> tuple[str, bool]:
    """(pooling, normalize) of a sentence-transformers directory's ``modules.json``; ``("", False)``
    without one.  Only Transformer -> Pooling(mean) [-> Normalize] can be expressed."""
    path = Path(hf_dir) / "modules.json"
    if not path.is_file():
        return "", False
    try:
        modules = json.loads(path.read_text(encoding="utf-8"))
        kinds = [(m["type"].rsplit(".", 1)[-1], m.get("path", "")) for m in modules]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise HFImportError(f"{path}: not a sentence-transformers modules list ({e})") from None
    names = [k for k, _ in kinds]
    if names not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise HFImportError(f"{path}: modules {names} are not supported; only Transformer -> Pooling "
                            f"(mean) -> optional Normalize")
    pool_config = Path(hf_dir) / kinds[1][1] / "config.json"
    try:
        pool = json.loads(pool_config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise HFImportError(f"cannot read the Pooling config {pool_config}: {e}") from None
    modes = sorted(k for k, v in pool.items() if k.startswith("pooling_mode_") and v)
    if modes != ["pooling_mode_mean_tokens"]:
        raise HFImportError(f"{pool_config}: pooling {modes or 'none'} is not supported; only "
                            f"pooling_mode_mean_tokens")
    return "mean", names[-1] == "Normalize"


def sentence_max_length(hf_dir: str | Path, positions: int) -> int | None:
    """``max_seq_length`` of a sentence-transformers directory's ``sentence_bert_config.json``, or
    None without one (or without the key).  It wins over the tokenizer's own truncation: all-MiniLM-
    L6-v2's tokenizer.json truncates at 128 tokens, ``SentenceTransformer`` at 256."""
    path = Path(hf_dir) / "sentence_bert_config.json"
    if not path.is_file():
        return None
    try:
        length = json.loads(path.read_text(encoding="utf-8")).get("max_seq_length")
    except (UnicodeDecodeError, ValueError, AttributeError) as e:
        raise HFImportError(f"{path}: not a sentence-transformers config ({e})") from None
    if length is None:
        return None
    if not isinstance(length, int) or isinstance(length, bool) or not 0 < length <= positions:
        raise HFImportError(f"{path}: max_seq_length {length!r} is not a token count in 1..{positions} "
                            f"(the model's max_position_embeddings)")
    return length


# -- the graph -------------------------------------------------------------------------------------
def _layer_norm(b: GraphBuilder, cfg: EncoderConfig, x: str, prefix: str, out: str) -> str:
    weight, bias = b.weight(prefix + ".weight", cfg.hidden), b.weight(prefix + ".bias", cfg.hidden)
    return b.emit(LayerNorm(eps=cfg.eps), [x, weight, bias], out)


def _build(cfg: EncoderConfig) -> GraphBuilder:
    b, hd = GraphBuilder(), cfg.hidden
    e = "embeddings."
    word = b.emit(TokenEmbed(), ["input_ids", b.weight(e + "word_embeddings.weight", cfg.vocab, hd)], "word")
    # [B, T, 1] -> [B, 1, 1, T]: broadcast over heads and query rows
    additive = b.emit(TokenEmbed(), ["attention_mask", b.weight(MASK_ADDITIVE, 2, 1)], "mask_rows")
    mask = b.emit(Reshape(shape=(0, 1, 1, -1)), [additive], "mask")
    type_table = b.weight(e + "token_type_embeddings.weight", cfg.type_vocab, hd)
    types = b.emit(TokenEmbed(), ["token_type_ids", type_table], "types")
    positions = b.emit(PosEmbed(), [word, b.weight(e + "position_embeddings.weight", cfg.positions, hd)], "positions")
    h = b.emit(Add(), [b.emit(Add(), [word, types], "word_types"), positions], "embedded")
    h = _layer_norm(b, cfg, h, e + "LayerNorm", "h_embed")
    attention = Sdpa(num_heads=cfg.heads, kv_heads=cfg.heads, head_dim=cfg.head_dim, causal=False)
    for i in range(cfg.layers):
        w, p = f"encoder.layer.{i}.", f"l{i}_"
        last = i == cfg.layers - 1
        q, k, v = (b.linear(h, w + "attention.self." + n, hd, hd, True, p + n[0]) for n in ("query", "key", "value"))
        a = b.emit(attention, [q, k, v, mask], p + "attn")
        a = b.linear(a, w + "attention.output.dense", hd, hd, True, p + "attn_out")
        h = _layer_norm(b, cfg, b.emit(Add(), [h, a], p + "resid_attn"), w + "attention.output.LayerNorm", p + "h_attn")
        m = b.linear(h, w + "intermediate.dense", cfg.ffn, hd, True, p + "up")
        m = b.linear(b.emit(Gelu(approximate=False), [m], p + "act"), w + "output.dense", hd, cfg.ffn, True, p + "down")
        h = _layer_norm(b, cfg, b.emit(Add(), [h, m], p + "resid_mlp"), w + "output.LayerNorm",
                        "last_hidden_state" if last else p + "h")
    if cfg.pooling:
        _mean_pool(b, cfg, h)
    return b


def _mean_pool(b: GraphBuilder, cfg: EncoderConfig, h: str) -> None:
    keep = b.emit(TokenEmbed(), ["attention_mask", b.weight(MASK_KEEP, 2, 1)], "keep_rows")
    keep = b.emit(Reshape(shape=(0, 1, -1)), [keep], "keep")  # [B, 1, T]
    total = b.emit(Matmul(transpose_b=False), [keep, h], "pool_sum")  # [B, 1, H]
    count = b.emit(Matmul(transpose_b=True), [keep, keep], "pool_count")  # [B, 1, 1]
    pooled = b.emit(Div(), [total, count], "pool_mean")
    out = "sentence_embedding"
    pooled = b.emit(Reshape(shape=(0, -1)), [pooled], "pooled" if cfg.normalize else out)
    if cfg.normalize:
        b.emit(RmsNorm(eps=_NORMALIZE_FLOOR / cfg.hidden), [pooled, b.weight(NORMALIZE_SCALE, cfg.hidden)], out)


def outputs(cfg: EncoderConfig) -> list[str]:
    return ["last_hidden_state", "sentence_embedding"] if cfg.pooling else ["last_hidden_state"]


def encoder_graph(cfg: EncoderConfig) -> Graph:
    """The encoder graph; weights are named only (see ``common.with_weight_specs``)."""
    return Graph(_build(cfg).nodes, [TensorSpec((-1, -1), DType.I32)] * len(INPUTS), outputs(cfg), {})


def weight_shapes(cfg: EncoderConfig) -> dict[str, tuple[int, ...]]:
    return _build(cfg).weights


def constants(cfg: EncoderConfig) -> dict[str, np.ndarray]:
    """The tensors the graph reads that no checkpoint holds."""
    out = {MASK_ADDITIVE: np.array([[np.finfo(np.float32).min], [0.0]], np.float32),
           MASK_KEEP: np.array([[0.0], [1.0]], np.float32)}
    if cfg.normalize:
        out[NORMALIZE_SCALE] = np.full(cfg.hidden, 1 / np.sqrt(cfg.hidden), np.float32)
    return out


# -- conversion ------------------------------------------------------------------------------------
def _tokenizer(hf_dir: Path, max_length: int | None) -> bytes | None:
    """``tokenizer.json`` without its padding: a fixed-length padding (all-MiniLM-L6-v2's pads
    every text to 128) would make ``Tokenizer.encode`` return pad ids, which transformers' tokenizers
    do not for a single text; ``dist_runtime.embed`` pads a batch itself.  With ``max_length``
    (sentence-transformers'), it truncates there, as ``SentenceTransformer`` does."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise HFImportError(f"{path} is not valid JSON: {e}") from None
    data["padding"] = None
    if max_length is not None:
        data["truncation"] = {"direction": "Right", "max_length": max_length, "strategy": "LongestFirst",
                              "stride": 0}
    return json.dumps(data, ensure_ascii=False).encode("utf-8")


def load(hf_dir: str | Path, dtype: str = "f32", *, progress: bool = False, deferred: bool = False) -> Imported:
    """Read a BERT-family model directory and convert it (the entry point of the ``hf`` package's dispatch)."""
    hf_dir = Path(hf_dir)
    config = read_config(hf_dir)
    cfg = encoder_config(config, *sentence_transformers_head(hf_dir))
    max_length = sentence_max_length(hf_dir, cfg.positions) if cfg.pooling else None
    graph, weights, source_dtypes, ignored = read_weights(
        hf_dir, encoder_graph(cfg), weight_shapes(cfg), dtype, prefixes=("", "bert."), made=constants(cfg),
        what="BERT encoder", progress=progress, deferred=deferred)
    metadata = {
        "name": config.get("_name_or_path") or hf_dir.resolve().name,
        "architecture": "bert",
        "created_by": "dist-runtime convert",
        "source": {"format": "huggingface", "class": (config.get("architectures") or ["BertModel"])[0],
                   "dtypes": dict(source_dtypes), "directory": hf_dir.resolve().name},
        "dtype": dtype,
        "config": {**asdict(cfg), "context_length": cfg.positions},
        "inputs": list(INPUTS),
    }
    if max_length is not None:
        metadata["max_seq_length"] = max_length
    tokenizer = _tokenizer(hf_dir, max_length)
    return Imported(graph, weights, metadata, "bert", source_dtypes, ignored, tokenizer, cfg)


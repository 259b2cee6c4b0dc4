"""Hugging Face importer for the Llama family: Llama, Mistral, Qwen2 and Phi.

A Hugging Face model directory holds ``config.json`` and the weights as ``*.safetensors`` (one
file, or shards listed by ``model.safetensors.index.json``).  :func:`decoder_config` reads the
config into a :class:`DecoderConfig`, the architecture-neutral description of a decoder-only
transformer that :func:`decoder_graph` turns into a Graph IR; :func:`load_hf` reads and converts the
weights; :func:`convert_hf` writes the result as a ``.model`` (``dist-runtime convert``).

The graph, per layer (``h`` the residual stream, ``x`` a normalised copy)::

    x = Norm(h)                                  RmsNorm, or LayerNorm with bias (Phi)
    q, k, v = x @ Wq^T (+bq), x @ Wk^T (+bk), x @ Wv^T (+bv)
    q, k = Rope(q, pos), Rope(k, pos)            rotate-half, first rope_dim dims of each head
    k_all, v_all = KvCache(k, v)
    a = Sdpa(q, k_all, v_all) @ Wo^T (+bo)       end-aligned causal, grouped-query; SdpaWindow
                                                 for a sliding-window layer (Mistral, Qwen2)
    sequential:  h = h + a;  h = h + Mlp(Norm2(h))
    parallel:    h = (a + Mlp(x)) + h            Phi: attention and MLP read the same x

with ``Mlp`` = SwiGLU (gate, up, down) or GELU (fc1, fc2, with biases), then a final norm and the
``lm_head`` matmul to ``logits [T, vocab]`` (f32).  ``lm_head`` reads ``model.embed_tokens.weight``
when the embeddings are tied.  Weight names are Hugging Face's, matmul weights stay ``[out, in]``
as stored (``Matmul(transpose_b=True)``).

Reading weights needs the ``safetensors`` package (``pip install 'dist-runtime[importers]'``);
building graphs does not, and nothing here imports torch or transformers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ...dtypes import DType
from ...ir.builder import GraphBuilder
from ...ir.graph import POS, Graph, TensorSpec
from ...ir.ops import (Add, Gelu, KvCache, LayerNorm, RmsNorm, Rope, Sample, Sdpa, SdpaWindow,
                       SwiGlu, TokenEmbed)
from ..common import ConvertReport, Imported, write_imported
from .common import HFImportError, chat_template_of, read_config, read_weights, token_ids

#: model_type -> the transformers class of each supported architecture.
SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "phi": "PhiForCausalLM",
}
EMBED = "model.embed_tokens.weight"


# -- the architecture-neutral description ----------------------------------------------------------
@dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only transformer of the Llama family, as the graph builder needs it."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    architecture: str = "llama"
    rope_base: float = 10000.0
    rope_dim: int = 0  # rotated dims per head; 0 = head_dim (full rotation)
    eps: float = 1e-5
    norm: str = "rms"  # "rms" (RmsNorm) or "layer" (LayerNorm with weight and bias)
    mlp: str = "swiglu"  # "swiglu" (gate, up, down), "gelu" (erf) or "gelu_tanh" (fc1, fc2)
    parallel: bool = False  # attention and MLP both read the input norm's output (Phi)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    lm_head_bias: bool = False
    tied: bool = False  # lm_head reads the embedding table
    windows: tuple[int, ...] = ()  # per layer: sliding window length, 0 = full causal attention
    context_length: int = 0  # max_position_embeddings (0 = unknown)
    sample: bool = False  # append a greedy Sample -> "next_token" (the example model's graph)

    def __post_init__(self) -> None:
        dims = {"vocab": self.vocab, "hidden": self.hidden, "layers": self.layers, "heads": self.heads,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "ffn": self.ffn}
        bad = {k: v for k, v in dims.items() if not (isinstance(v, int) and v >= 1)}
        if bad:
            raise HFImportError(f"model dimensions must be positive integers, got {bad}")
        if self.heads % self.kv_heads:
            raise HFImportError(f"num_attention_heads {self.heads} is not a multiple of "
                                f"num_key_value_heads {self.kv_heads}")
        r = self.rotary_dims
        if r % 2 or not 2 <= r <= self.head_dim:
            raise HFImportError(f"rotary dims {r} must be even and in [2, head_dim={self.head_dim}]")
        if self.windows and len(self.windows) != self.layers:
            raise HFImportError(f"{len(self.windows)} sliding windows for {self.layers} layers")
        if self.norm not in ("rms", "layer") or self.mlp not in ("swiglu", "gelu", "gelu_tanh"):
            raise HFImportError(f"unknown norm {self.norm!r} or mlp {self.mlp!r}")

    @property
    def rotary_dims(self) -> int:
        return self.rope_dim or self.head_dim

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0


def _norm(b: GraphBuilder, cfg: DecoderConfig, x: str, prefix: str, out: str) -> str:
    weight = b.weight(prefix + ".weight", cfg.hidden)
    if cfg.norm == "rms":
        return b.emit(RmsNorm(eps=cfg.eps), [x, weight], out)
    return b.emit(LayerNorm(eps=cfg.eps), [x, weight, b.weight(prefix + ".bias", cfg.hidden)], out)


def _build(cfg: DecoderConfig) -> GraphBuilder:
    b = GraphBuilder()
    phi = cfg.architecture == "phi"
    attn_o, final_norm = ("dense", "model.final_layernorm") if phi else ("o_proj", "model.norm")
    q_dim, kv_dim = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    rope = Rope(head_dim=cfg.head_dim, rope_dim=cfg.rotary_dims, base=cfg.rope_base)
    h = b.emit(TokenEmbed(), ["tokens", b.weight(EMBED, cfg.vocab, cfg.hidden)], "h_embed")
    for i in range(cfg.layers):
        w, p = f"model.layers.{i}.", f"l{i}_"
        x = _norm(b, cfg, h, w + "input_layernorm", p + "attn_in")
        q = b.linear(x, w + "self_attn.q_proj", q_dim, cfg.hidden, cfg.qkv_bias, p + "q")
        k = b.linear(x, w + "self_attn.k_proj", kv_dim, cfg.hidden, cfg.qkv_bias, p + "k")
        v = b.linear(x, w + "self_attn.v_proj", kv_dim, cfg.hidden, cfg.qkv_bias, p + "v")
        q = b.emit(rope, [q, POS], p + "q_rot")
        k = b.emit(rope, [k, POS], p + "k_rot")
        k_all, v_all = b.emit(KvCache(), [k, v], [p + "k_all", p + "v_all"])
        heads = dict(num_heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim)
        window = cfg.window(i)
        attention = SdpaWindow(**heads, window=window, causal=True) if window else Sdpa(**heads, causal=True)
        a = b.emit(attention, [q, k_all, v_all], p + "attn")
        o = b.linear(a, w + "self_attn." + attn_o, cfg.hidden, q_dim, cfg.o_bias, p + "attn_out")
        if cfg.parallel:
            m = _mlp(b, cfg, x, w, p)
            h = b.emit(Add(), [b.emit(Add(), [o, m], p + "attn_mlp"), h], p + "resid")
        else:
            h = b.emit(Add(), [h, o], p + "resid_attn")
            x = _norm(b, cfg, h, w + "post_attention_layernorm", p + "mlp_in")
            h = b.emit(Add(), [h, _mlp(b, cfg, x, w, p)], p + "resid_mlp")
    x = _norm(b, cfg, h, final_norm, "final_norm")
    b.linear(x, "lm_head", cfg.vocab, cfg.hidden, cfg.lm_head_bias, "logits", EMBED if cfg.tied else None)
    if cfg.sample:
        b.emit(Sample(), ["logits"], "next_token")
    return b


def _mlp(b: GraphBuilder, cfg: DecoderConfig, x: str, w: str, p: str) -> str:
    if cfg.mlp == "swiglu":
        gate = b.linear(x, w + "mlp.gate_proj", cfg.ffn, cfg.hidden, cfg.mlp_bias, p + "gate")
        up = b.linear(x, w + "mlp.up_proj", cfg.ffn, cfg.hidden, cfg.mlp_bias, p + "up")
        act = b.emit(SwiGlu(), [gate, up], p + "act")
        return b.linear(act, w + "mlp.down_proj", cfg.hidden, cfg.ffn, cfg.mlp_bias, p + "down")
    fc1 = b.linear(x, w + "mlp.fc1", cfg.ffn, cfg.hidden, cfg.mlp_bias, p + "fc1")
    act = b.emit(Gelu(approximate=cfg.mlp == "gelu_tanh"), [fc1], p + "act")
    return b.linear(act, w + "mlp.fc2", cfg.hidden, cfg.ffn, cfg.mlp_bias, p + "down")


def decoder_graph(cfg: DecoderConfig) -> Graph:
    """The decoder graph: input ``tokens`` (i32[-1]), output ``logits`` (and ``next_token`` when
    ``cfg.sample``).  Weights are named only; ``save_model`` or ``common.with_weight_specs`` fills
    ``graph.weights``."""
    outputs = ["logits", "next_token"] if cfg.sample else ["logits"]
    return Graph(_build(cfg).nodes, [TensorSpec((-1,), DType.I32)], outputs, {})


def weight_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the graph reads, with its shape, in order of first use."""
    return _build(cfg).weights


def random_weights(cfg: DecoderConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random f32 weights for ``cfg``, in graph order: matrices ``N(0, 1/in)``, norm scales
    ``1 + N(0, 0.01)``, biases ``N(0, 0.01)``."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if len(shape) == 2:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        elif name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        else:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        out[name] = w.astype(np.float32)
    return out


# -- config.json -----------------------------------------------------------------------------------
def _supported_list() -> str:
    return ", ".join(f"{cls} (model_type {mt!r})" for mt, cls in SUPPORTED.items())


def architecture_of(config: Mapping) -> str:
    """The supported model_type a config describes, or HFImportError listing the supported ones."""
    model_type = config.get("model_type")
    classes = list(config.get("architectures") or [])
    if model_type in SUPPORTED:
        return model_type
    for cls in classes:
        for mt, known in SUPPORTED.items():
            if cls == known:
                return mt
    what = " / ".join(repr(x) for x in [model_type, *classes] if x) or "none given"
    raise HFImportError(f"unsupported architecture {what}; supported: {_supported_list()}")


def _rope(config: Mapping, arch: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from transformers 4's flat keys or 5's rope_parameters;
    any rope scaling is refused."""
    params = config.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise HFImportError(f"rope_parameters must be a table, got {params!r}")
    scaling = config.get("rope_scaling")
    for source, table in (("rope_scaling", scaling), ("rope_parameters", params)):
        if not table:
            continue
        kind = table.get("rope_type", table.get("type", "default")) if isinstance(table, Mapping) else table
        if kind != "default":
            raise HFImportError(
                f"{source} {kind!r} is not supported: Rope applies no scaling (linear, dynamic NTK, "
                f"YaRN, Llama 3, LongRoPE); only rope_type 'default' can be imported")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor",
                         config.get("partial_rotary_factor", 0.5 if arch == "phi" else 1.0))
    if arch != "phi" and partial != 1.0:
        raise HFImportError(f"partial_rotary_factor {partial} is only supported for Phi")
    return float(theta), float(partial)


def _windows(config: Mapping, arch: str, layers: int, context: int) -> tuple[int, ...]:
    """Per-layer sliding window (0 = full attention), as transformers decides it."""
    window = config.get("sliding_window")
    if arch == "mistral":
        sliding = [window is not None] * layers
    elif arch == "qwen2":
        types = config.get("layer_types")
        if types is not None:
            unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
            if unknown or len(types) != layers:
                raise HFImportError(f"layer_types {types} must give 'full_attention' or "
                                    f"'sliding_attention' for each of the {layers} layers")
            sliding = [t == "sliding_attention" for t in types]
        else:  # transformers 4: use_sliding_window from layer max_window_layers on
            first = config.get("max_window_layers", 28)
            sliding = [bool(config.get("use_sliding_window")) and i >= first for i in range(layers)]
    else:
        sliding = [False] * layers
    if not any(sliding):
        return ()
    if not (isinstance(window, int) and window >= 1):
        raise HFImportError(f"sliding_window must be a positive integer, got {window!r}")
    if context and window >= context:  # the window never excludes a key: plain causal attention
        return ()
    return tuple(window if s else 0 for s in sliding)


_GELU = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def decoder_config(config: Mapping) -> DecoderConfig:
    """The :class:`DecoderConfig` of a Hugging Face ``config.json`` (as a dict)."""
    arch = architecture_of(config)

    def need(key: str):
        if config.get(key) is None:
            raise HFImportError(f"config.json lacks {key!r}, which a {SUPPORTED[arch]} needs")
        return config[key]

    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise HFImportError(f"pre-quantized checkpoints ({method}) are not supported; convert the "
                            f"float checkpoint and use --dtype q8_0 or q4_0")
    hidden, heads, layers = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    kv_heads = config.get("num_key_value_heads") or heads
    if not config.get("head_dim") and hidden % heads:
        raise HFImportError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                            f"and config.json gives no head_dim")
    head_dim = config.get("head_dim") or hidden // heads
    theta, partial = _rope(config, arch)
    act = config.get("hidden_act", "gelu_new" if arch == "phi" else "silu")
    context = int(config.get("max_position_embeddings") or 0)
    common = dict(vocab=need("vocab_size"), hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                  head_dim=head_dim, ffn=need("intermediate_size"), architecture=arch, rope_base=theta,
                  tied=bool(config.get("tie_word_embeddings", False)), context_length=context,
                  windows=_windows(config, arch, layers, context))
    if arch == "phi":
        if config.get("qk_layernorm"):
            raise HFImportError("Phi with qk_layernorm=true is not supported")
        if act not in _GELU:
            raise HFImportError(f"Phi hidden_act {act!r} is not supported; supported: {sorted(_GELU)}")
        return DecoderConfig(**common, rope_dim=int(head_dim * partial), eps=config.get("layer_norm_eps", 1e-5),
                             norm="layer", mlp=_GELU[act], parallel=True, qkv_bias=True, o_bias=True,
                             mlp_bias=True, lm_head_bias=True)
    if act not in ("silu", "swish"):
        raise HFImportError(f"{SUPPORTED[arch]} hidden_act {act!r} is not supported (SwiGLU needs 'silu')")
    bias = bool(config.get("attention_bias", False)) if arch == "llama" else False
    return DecoderConfig(**common, eps=config.get("rms_norm_eps", 1e-6),
                         qkv_bias=arch == "qwen2" or bias, o_bias=bias,
                         mlp_bias=bool(config.get("mlp_bias", False)) if arch == "llama" else False)


# -- conversion ------------------------------------------------------------------------------------
def load_hf(hf_dir: str | Path, dtype: str = "f32", *, progress: bool = False, deferred: bool = False) -> Imported:
    """Read a Hugging Face model directory and convert it: graph, weights (``dtype`` per
    ``common.storage_targets``; ``deferred``: read when written), metadata.  Checkpoint tensors
    the graph does not read are skipped."""
    hf_dir = Path(hf_dir)
    config = read_config(hf_dir)
    cfg = decoder_config(config)
    graph, weights, source_dtypes, ignored = read_weights(
        hf_dir, decoder_graph(cfg), weight_shapes(cfg), dtype, prefixes=("",), made={},
        what=SUPPORTED[cfg.architecture], progress=progress, deferred=deferred)
    metadata = {
        "name": config.get("_name_or_path") or hf_dir.resolve().name,
        "architecture": cfg.architecture,
        "created_by": "dist-runtime convert",
        "source": {"format": "huggingface", "class": SUPPORTED[cfg.architecture],
                   "dtypes": dict(source_dtypes), "directory": hf_dir.resolve().name},
        "dtype": dtype,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items() if k != "sample"},
        **token_ids(hf_dir, config),
        **chat_template_of(hf_dir),
    }
    tokenizer = hf_dir / "tokenizer.json"
    return Imported(graph, weights, metadata, cfg.architecture, source_dtypes, ignored,
                    tokenizer if tokenizer.is_file() else None, cfg)


def convert_hf(hf_dir: str | Path, out: str | Path, dtype: str = "f32", *, progress: bool = False) -> ConvertReport:
    """``dist-runtime convert HF_DIR``: write ``out`` (graph + weights) and, when
    ``HF_DIR/tokenizer.json`` exists, a copy of it beside ``out`` (named in the metadata)."""
    start = time.perf_counter()
    return write_imported(load_hf(hf_dir, dtype, progress=progress, deferred=True), out, "huggingface", start,
                          progress=progress)


def load(hf_dir: str | Path, dtype: str = "f32", *, progress: bool = False, deferred: bool = False) -> Imported:
    """The entry point of the ``hf`` package's dispatch: :func:`load_hf`."""
    return load_hf(hf_dir, dtype, progress=progress, deferred=deferred)

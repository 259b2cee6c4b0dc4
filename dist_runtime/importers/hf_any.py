"""Hugging Face model directories: pick the importer by ``config.json``'s ``model_type``.

Every importer module named here has ``load(hf_dir, dtype, *, progress) -> common.Imported``.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path

from . import hf_model_type
from .common import ConvertReport, write_imported
from .hf import HFImportError

#: model_type -> the module (in this package) that imports it.
ARCHITECTURES = {
    "llama": "hf", "mistral": "hf", "qwen2": "hf", "phi": "hf",
    "bert": "hf_encoder", "gpt2": "hf_gpt2",
}


def load_hf_dir(hf_dir: str | Path, dtype: str | None = None, *, progress: bool = False):
    model_type = hf_model_type(hf_dir)
    module = ARCHITECTURES.get(model_type)
    if module is None:
        raise HFImportError(f"{Path(hf_dir) / 'config.json'}: model_type {model_type!r} is not supported; "
                            f"supported: {', '.join(sorted(ARCHITECTURES))}")
    return importlib.import_module(f"{__package__}.{module}").load(hf_dir, dtype or "f32", progress=progress)


def convert_hf_dir(hf_dir: str | Path, out: str | Path, dtype: str | None = None, *,
                   progress: bool = False) -> ConvertReport:
    start = time.perf_counter()
    return write_imported(load_hf_dir(hf_dir, dtype, progress=progress), out, "huggingface", start)

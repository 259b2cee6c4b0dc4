"""Importers: turn models from other formats into our Graph IR and a ``.model`` file.

* ``hf``: Hugging Face directories (``config.json`` + ``*.safetensors``), one module per family:
  ``hf.llama`` (Llama, Mistral, Qwen2, Phi), ``hf.gpt2``, ``hf.encoder`` (BERT-family encoders).
* ``gguf_file``: llama.cpp's GGUF files, quantized tensors kept as stored.
* ``onnx``: ONNX graphs (the importer in ``onnx.model``), one converter per operator in the
  package's family modules (also the mapping the ONNX conformance suite runs through).

:func:`detect_format` tells which a path is; :func:`convert` (``dist-runtime convert``) runs the
right importer and writes the result through ``common.write_imported``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..errors import DistRuntimeError

#: Storage types ``convert --dtype`` offers for matmul weights (light: the CLI's parser lists them).
DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")

#: format -> (module, function converting ``(source, out, dtype, progress=)`` to a ConvertReport)
IMPORTERS = {
    "huggingface": ("hf", "convert_hf_dir"),
    "gguf": ("gguf_file", "convert_gguf"),
    "onnx": ("onnx.model", "convert_onnx"),
}


def detect_format(source: str | Path) -> str:
    """``huggingface`` for a directory with config.json, ``gguf`` or ``onnx`` by magic/extension."""
    p = Path(source)
    if p.is_dir():
        if (p / "config.json").is_file():
            return "huggingface"
        raise DistRuntimeError(f"{p} is a directory without config.json: not a Hugging Face model directory")
    if not p.is_file():
        raise DistRuntimeError(f"no such file or directory: {p}")
    with open(p, "rb") as f:
        head = f.read(4)
    if head == b"GGUF":
        return "gguf"
    if p.suffix.lower() == ".onnx":
        return "onnx"
    if p.suffix.lower() == ".gguf":
        raise DistRuntimeError(f"{p} ends in .gguf but does not start with the GGUF magic (starts with {head!r})")
    raise DistRuntimeError(f"cannot tell the format of {p}: expected a Hugging Face directory, "
                           f"a .gguf file or an .onnx file")


def check_output(out: str | Path) -> None:
    """Refuse, before any conversion work, an output path that cannot be written."""
    import os

    out = Path(out)
    if out.is_dir():
        raise DistRuntimeError(f"-o {out} is a directory: give the file to write, e.g. {out / 'model.model'}")
    folder = next((p for p in [out.parent, *out.parent.parents] if p.exists()), Path("."))
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise DistRuntimeError(f"-o {out}: cannot create files in {folder}")


def convert(source: str | Path, out: str | Path, dtype: str | None = None, *, progress: bool = False):
    """Convert ``source`` (any supported format) to ``out``; returns a ``common.ConvertReport``."""
    check_output(out)
    module, func = IMPORTERS[detect_format(source)]
    convert_fn = getattr(importlib.import_module(f"{__name__}.{module}"), func)
    return convert_fn(source, out, dtype, progress=progress)


"""What every importer shares: the converted result, the progress bar, the weight specs of a
graph, writing and reporting.

An importer (``hf``, ``gguf_file``, ``onnx``, ...) reads its source format into an
:class:`Imported` (graph with weight specs, weights, metadata); :func:`write_imported` writes it as
a ``.model`` (atomically: ``save_model`` writes a temporary file and renames it, so a failed
conversion leaves nothing behind) with its tokenizer beside it, and returns a
:class:`ConvertReport` of what was written: tensors, bytes, the dtype mix and the ops used.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from ..dtypes import DType
from . import DTYPES  # noqa: F401  (re-exported: every importer checks --dtype against it)
from ..ir.graph import Graph, TensorSpec
from ..ir.ops import TokenEmbed
from ..tensor import Array, Deferred, QuantizedArray, dtype_of


@dataclass
class Imported:
    """A converted model: the graph (with weight specs), the weights, metadata and what was done."""

    graph: Graph
    weights: dict[str, Array]
    metadata: dict
    architecture: str
    source_dtypes: dict[str, int] = field(default_factory=dict)  # source dtype -> tensor count
    ignored: list[str] = field(default_factory=list)  # source tensors the graph does not read
    tokenizer: Path | bytes | None = None  # a tokenizer.json to copy, or its bytes
    config: object = None  # the importer's own description (DecoderConfig, EncoderConfig, ...)

    @property
    def stored(self) -> dict[str, str]:
        """weight -> the dtype it is stored as (``f32``, ``q8_0``, ...)."""
        return {n: stored_dtype(w) for n, w in self.weights.items()}


def stored_dtype(w: Array | Deferred) -> str:
    return dtype_of(w).name.lower()


class Progress:
    """tqdm when it is installed, else a one-line counter on stderr; nothing when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool, unit: str = "tensor") -> None:
        self.total, self.desc, self.n, self._bar = total, desc, 0, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled:
            width = 30
            done = width * self.n // max(self.total, 1)
            print(f"\r{self.desc} [{'#' * done}{'.' * (width - done)}] {self.n}/{self.total}",
                  end="" if self.n < self.total else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def storage_targets(graph: Graph, dtype: DType) -> dict[str, DType]:
    """The weights stored as ``dtype``; every other weight stays f32.

    Only 2-D weights that every reader takes in a weight slot (``OpSpec.weight_inputs``: Matmul's
    ``b``, TokenEmbed's table) change type, and a block type also needs the last dim to be a
    multiple of its block.  f16/bf16 leave TokenEmbed tables in f32: a table lookup has its table's
    dtype, so a half table would make every activation after it half precision.
    """
    consumers = graph.index.consumers
    out = {}
    for name, spec in graph.weights.items():
        readers = [graph.nodes[i] for i in consumers.get(name, [])]
        ok = (len(spec.shape) == 2 and dtype != DType.F32
              and all(slot in node.op.spec.weight_inputs
                      for node in readers for slot, n in enumerate(node.inputs) if n == name)
              and (spec.shape[-1] % dtype.block_size == 0 if dtype.is_quantized
                   else not any(isinstance(node.op, TokenEmbed) for node in readers)))
        out[name] = dtype if ok else DType.F32
    return out


def tokenizer_path_for(model_path: str | Path) -> Path:
    """Where ``convert`` puts the tokenizer of ``model_path``: ``NAME.tokenizer.json`` beside it."""
    p = Path(model_path)
    return p.with_name(p.stem + ".tokenizer.json")


@dataclass
class ConvertReport:
    out: Path
    format: str  # huggingface, gguf, onnx
    architecture: str
    tensors: int
    bytes: int
    dtypes: dict[str, int]  # stored dtype -> tensor count
    ops: dict[str, int]  # op name -> node count
    stored: dict[str, str]  # weight -> stored dtype
    ignored: list[str]
    tokenizer: Path | None
    seconds: float

    def as_dict(self) -> dict:
        d = asdict(self)
        d["out"], d["tokenizer"] = str(self.out), self.tokenizer and str(self.tokenizer)
        return d


def write_imported(imported: Imported, out: str | Path, source_format: str, started: float | None = None, *,
                   progress: bool = False) -> ConvertReport:
    """Write ``imported`` to ``out`` (and its tokenizer to :func:`tokenizer_path_for`); a bar
    shows the write of large weights with ``progress``."""
    from ..model import save_model

    start = time.perf_counter() if started is None else started
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = dict(imported.metadata)
    tokenizer = None
    if imported.tokenizer is not None:
        tokenizer = tokenizer_path_for(out)
        metadata["tokenizer"] = tokenizer.name
    weights, bar = _counted(imported.weights, progress)
    try:
        model = save_model(out, imported.graph, weights, metadata, progress=progress and bar is None)
    finally:
        if bar is not None:
            bar.close()
    size = sum(s.size for s in model.index.values())
    model.close()
    if isinstance(imported.tokenizer, (bytes, bytearray)):
        tmp = tokenizer.with_name(tokenizer.name + ".tmp")
        tmp.write_bytes(imported.tokenizer)
        tmp.replace(tokenizer)
    elif imported.tokenizer is not None:
        shutil.copyfile(imported.tokenizer, tokenizer)
    stored = imported.stored
    return ConvertReport(out, source_format, imported.architecture, len(imported.weights), size,
                         dict(Counter(stored.values())), dict(Counter(n.op.spec.name for n in imported.graph.nodes)),
                         stored, imported.ignored, tokenizer, time.perf_counter() - start)


def _counted(weights: Mapping[str, Array | Deferred], progress: bool) -> tuple[dict, Progress | None]:
    """``weights`` with each deferred one counted on a "converting" bar as it is written (it is
    read then: the conversion's progress), and the bar; None when nothing is deferred."""
    if not any(isinstance(w, Deferred) for w in weights.values()):
        return dict(weights), None
    bar = Progress(sum(isinstance(w, Deferred) for w in weights.values()), "converting", progress)

    def counted(done):
        return lambda: (done and done(), bar.update())
    return {n: replace(w, done=counted(w.done)) if isinstance(w, Deferred) else w for n, w in weights.items()}, bar


#: Bytes of f32 rows re-encoded at once (a band's encoder temporaries, several times its input,
#: stay small whatever the matrix: one 96 MiB matrix at once peaked at 816 MiB).
QUANTIZE_BAND = 16 * 2**20


def quantize_rows(w: Array, target: DType) -> Array:
    """``w`` (f32/f16 rows, or a block-quantized matrix, decoded band by band) re-encoded as
    ``target`` a band of rows at a time: the same bytes as the whole matrix at once (every
    encoder works row by row), within a small bound of memory beyond the result."""
    from ..kernels.quant import dequantize, quantize

    rows, width = (w.shape[0], w.shape[-1]) if len(w.shape) > 1 else (1, w.shape[0])
    if len(w.shape) != 2 or rows == 0:
        return quantize(dequantize(w) if isinstance(w, QuantizedArray) else w.astype(np.float32), target)
    step = max(1, QUANTIZE_BAND // max(4 * width, 1))
    out = None
    for i in range(0, rows, step):
        band = (dequantize(QuantizedArray(w.data[i:i + step], w.dtype, (min(step, rows - i), width)))
                if isinstance(w, QuantizedArray) else w[i:i + step].astype(np.float32))
        band = quantize(band, target)
        band = band.data if isinstance(band, QuantizedArray) else band
        if out is None:
            out = np.empty((rows, *band.shape[1:]), band.dtype)
        out[i:i + step] = band
    return QuantizedArray(out, target, (rows, width)) if target.is_quantized else out


def with_weight_specs(graph: Graph, weights: Mapping[str, Array]) -> Graph:
    """``graph`` with ``graph.weights`` describing ``weights`` (what a loaded .model's graph has)."""
    specs = {n: TensorSpec(tuple(w.shape), dtype_of(w)) for n, w in weights.items()}
    return Graph(list(graph.nodes), list(graph.inputs), list(graph.outputs), specs)

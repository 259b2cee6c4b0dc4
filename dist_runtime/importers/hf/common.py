"""What the Hugging Face importers share: a model directory's ``config.json``, its safetensors
checkpoint, reading the weights a graph names from it, and the bos/eos token ids.

Reading weights needs the ``safetensors`` package (``pip install 'dist-runtime[importers]'``);
nothing here imports torch or transformers.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from ...dtypes import DType
from ...errors import DistRuntimeError
from ...ir.graph import Graph, TensorSpec
from ...tensor import Array, Deferred
from ..chat_template import template_in
from ..common import DTYPES, Progress, quantize_rows, storage_targets, with_weight_specs


class HFImportError(DistRuntimeError):
    """A Hugging Face model directory this importer cannot convert; the message says why."""


# -- config.json -----------------------------------------------------------------------------------
def read_config(hf_dir: str | Path) -> dict:
    """``HF_DIR/config.json`` as a dict, with errors that say what is missing."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise HFImportError(f"{hf_dir} is not a directory (expected a Hugging Face model directory)")
    path = hf_dir / "config.json"
    if not path.is_file():
        raise HFImportError(f"{hf_dir} has no config.json: not a Hugging Face model directory")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFImportError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise HFImportError(f"{path} must hold a JSON object")
    return config


def chat_template_of(hf_dir: Path) -> dict:
    """``{"chat_template": ...}`` when the directory carries one (:mod:`..chat_template`)."""
    try:
        template = template_in(hf_dir)
    except DistRuntimeError as e:
        raise HFImportError(str(e)) from None
    return {"chat_template": template} if template else {}


def token_ids(hf_dir: Path, config: Mapping) -> dict:
    """bos/eos token ids: generation_config.json first (it is what generate() uses), then config."""
    sources = [config]
    gen = hf_dir / "generation_config.json"
    if gen.is_file():
        try:
            sources.insert(0, json.loads(gen.read_text(encoding="utf-8")))
        except ValueError:
            pass
    out = {}
    for key in ("bos_token_id", "eos_token_id"):
        for src in sources:
            value = src.get(key)
            if isinstance(value, int) or (isinstance(value, list) and value and all(isinstance(v, int) for v in value)):
                out[key] = value
                break
    return out


# -- safetensors checkpoints ------------------------------------------------------------------------
#: safetensors dtypes read (and widened to f32); integer and f8 tensors are refused.
_FLOATS = ("F32", "F16", "BF16", "F64")


class Checkpoint:
    """The tensors of ``HF_DIR/*.safetensors``: one file, or shards through their index.

    Use as a context manager; :meth:`get` returns a tensor as numpy (BF16 through ml_dtypes)."""

    def __init__(self, hf_dir: str | Path) -> None:
        try:
            import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, for BF16 tensors)
            from safetensors import safe_open
        except ImportError:
            raise HFImportError("reading safetensors needs the 'safetensors' package: "
                                "pip install 'dist-runtime[importers]'") from None
        self.dir = Path(hf_dir)
        self._stack = ExitStack()
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (KeyError, TypeError, ValueError) as e:
                raise HFImportError(f"{index}: not a safetensors index with a weight_map ({e})") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.dir / f).is_file()]
            if missing:
                raise HFImportError(f"{index} lists shards that are missing: {missing}")
        else:
            single = self.dir / "model.safetensors"
            files = [single.name] if single.is_file() else sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                others = sorted(p.name for p in self.dir.glob("*.bin"))
                hint = f" (found {others}: re-save with safe_serialization=True)" if others else ""
                raise HFImportError(f"{self.dir} has no *.safetensors weights{hint}")
            weight_map = None
        self._files: dict[str, object] = {}
        self.file_of: dict[str, str] = {}
        for name in files:
            try:
                handle = self._stack.enter_context(safe_open(str(self.dir / name), framework="numpy"))
            except Exception as e:  # safetensors raises its own error types for bad headers
                self.close()
                raise HFImportError(f"{self.dir / name}: not a readable safetensors file ({e})") from None
            self._files[name] = handle
            for key in handle.keys():
                if weight_map is None or weight_map.get(key) == name:
                    self.file_of.setdefault(key, name)
        if weight_map is not None:
            lost = sorted(k for k, f in weight_map.items() if k not in self.file_of)
            if lost:
                self.close()
                raise HFImportError(f"the index maps {lost[:5]} to shards that do not contain them")

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return list(self.file_of)

    def _slice(self, name: str):
        return self._files[self.file_of[name]].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def check_float(self, name: str) -> str:
        """Tensor ``name``'s safetensors dtype, an error unless a float one."""
        dtype = self.dtype(name)
        if dtype not in _FLOATS:
            raise HFImportError(f"tensor {name!r} is {dtype}; only float checkpoints "
                                f"({', '.join(_FLOATS)}) can be imported")
        return dtype

    def get(self, name: str) -> np.ndarray:
        self.check_float(name)
        return self._files[self.file_of[name]].get_tensor(name)


# -- reading weights -------------------------------------------------------------------------------
def checkpoint_prefix(names: Sequence[str], anchor: str, prefixes: Sequence[str], where: Path) -> str:
    """The prefix (of ``prefixes``) under which the checkpoint holds ``anchor``."""
    have = set(names)
    for prefix in prefixes:
        if prefix + anchor in have:
            return prefix
    tried = " or ".join(repr(p + anchor) for p in prefixes)
    raise HFImportError(f"the checkpoint in {where} has no {tried}: not the model its config.json describes")


def read_weights(hf_dir: Path, graph: Graph, shapes: Mapping[str, tuple[int, ...]], dtype: str, *,
                 prefixes: Sequence[str], made: Mapping[str, np.ndarray], transposed: frozenset[str] = frozenset(),
                 unprefixed: frozenset[str] = frozenset(), what: str, progress: bool = False,
                 deferred: bool = False) -> tuple[Graph, dict[str, Array | Deferred], dict[str, int], list[str]]:
    """Read the weights ``graph`` names from the checkpoint in ``hf_dir`` and store them as ``dtype``.

    A graph weight ``n`` is ``made[n]``, or the checkpoint tensor ``n`` when in ``unprefixed`` (a
    head beside the base model), else ``prefix + n`` for the first of ``prefixes`` under which the
    checkpoint holds ``shapes``' first weight; a name in ``transposed`` is stored ``[in, out]``
    in the checkpoint (GPT-2's Conv1D) and transposed here.  ``deferred``: each checkpoint tensor
    a :class:`~dist_runtime.tensor.Deferred`, read when it is written from its shard opened for
    it alone (the shard's map goes with it: ``convert`` holds one tensor at a time).  Every
    check is made before any tensor is read.  Returns the graph with weight specs, the weights,
    the checkpoint's dtype counts and the checkpoint tensors left unread."""
    if dtype not in DTYPES:
        raise HFImportError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    graph.weights = {n: TensorSpec(s, DType.F32) for n, s in shapes.items()}
    targets = storage_targets(graph, DType[dtype.upper()])
    wanted = [n for n in shapes if n not in made]
    weights: dict[str, Array | Deferred] = {}
    source_dtypes: dict[str, int] = {}
    with Checkpoint(hf_dir) as ckpt:
        prefix = checkpoint_prefix(ckpt.names(), wanted[0], prefixes, hf_dir)
        source = {n: n if n in unprefixed else prefix + n for n in wanted}
        stored = {n: shapes[n][::-1] if n in transposed else shapes[n] for n in wanted}
        missing = [n for n in wanted if source[n] not in ckpt.file_of]
        if missing:
            listed = ", ".join(f"{source[n]} {list(stored[n])}" for n in missing[:8])
            raise HFImportError(f"the checkpoint in {hf_dir} lacks {len(missing)} tensor(s) a {what} with this "
                                f"config.json needs: {listed}" + (" ..." if len(missing) > 8 else ""))
        wrong = [f"{source[n]}: {list(ckpt.shape(source[n]))}, expected {list(stored[n])}"
                 for n in wanted if ckpt.shape(source[n]) != stored[n]]
        if wrong:
            raise HFImportError(f"tensor shapes disagree with config.json: {'; '.join(wrong[:8])}")
        for n in wanted:
            kind = ckpt.check_float(source[n])
            source_dtypes[kind] = source_dtypes.get(kind, 0) + 1
        bar = Progress(len(shapes), "converting", progress and not deferred)  # deferred: the write shows it
        try:
            for name in shapes:
                if name in made:
                    weights[name] = _stored(made[name], targets[name])
                    continue
                read = functools.partial(_read, ckpt.dir / ckpt.file_of[source[name]], source[name],
                                         name in transposed, targets[name])
                weights[name] = Deferred(targets[name], tuple(shapes[name]), read) if deferred else read(ckpt)
                bar.update()
        finally:
            bar.close()
        ignored = sorted(set(ckpt.names()) - set(source.values()))
    return with_weight_specs(graph, weights), weights, source_dtypes, ignored


def _read(path: Path, key: str, transposed: bool, target: DType, ckpt: Checkpoint | None = None) -> Array:
    """Checkpoint tensor ``key`` of shard ``path`` as f32 (``[out, in]``), stored as ``target``:
    read through ``ckpt``'s open shards, or from the shard opened for it alone."""
    x = ckpt.get(key) if ckpt is not None else _read_alone(path, key)
    return _stored(np.ascontiguousarray(x.T if transposed else x, dtype=np.float32), target)


def _read_alone(path: Path, key: str) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as shard:
        return shard.get_tensor(key)


def _stored(x: np.ndarray, target: DType) -> Array:
    return x if target == DType.F32 else quantize_rows(x, target)

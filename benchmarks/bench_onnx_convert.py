"""Converting an ONNX model stored with external data: peak resident memory against its largest tensor.

The model: ``--layers`` MLP blocks (MatMul ``[hidden, ffn]``, Relu, MatMul ``[ffn, hidden]``) of
Llama-3.2-3B's widths (hidden 3072, FFN 8192) with random weights, 16 blocks by default: 32
tensors of 96 MiB in f32, 3.0 GiB, as ``model.onnx`` + ``model.onnx.data`` (what ONNX requires
over 2 GiB).  Every second block stores its down weight ``[hidden, ffn]`` behind a Transpose node,
as exporters write ``nn.Linear``: the importer folds it when the weight is written (a deferred
transform, which holds the weight and its transpose), unless ``--plain``.  ``--dtype f16`` stores
the weights in f16.  The model is written once into
``--cache`` (default ``~/.cache/dist-runtime-bench``), one tensor at a time, and reused.

Measured: ``dist-runtime convert`` of it in a child process of its own (peak resident memory:
``ru_maxrss``), and the same of a 1-block model of the same widths (what Python,
numpy, onnx and the converter take whatever the model), against the target of 1 GiB + the
largest tensor.  The converted file is deleted afterwards unless ``--keep``.

Run as::

    .venv/bin/python benchmarks/bench_onnx_convert.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

GIB, MIB = 2**30, 2**20
ALIGN = 4096  # ONNX recommends page-aligned offsets in external data


def _tensor(f, name: str, shape: tuple[int, ...], dtype: np.dtype, rng, location: str) -> TensorProto:
    """Write one random tensor at the next aligned offset of ``f``; its external TensorProto."""
    offset = -(-f.tell() // ALIGN) * ALIGN
    f.write(bytes(offset - f.tell()))
    array = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype, copy=False)
    f.write(memoryview(array).cast("B"))
    t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(dtype), dims=shape,
                    data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", offset), ("length", array.nbytes)):
        t.external_data.add(key=key, value=str(value))
    return t


def write_model(folder: Path, layers: int, hidden: int, ffn: int, dtype: np.dtype, plain: bool = False,
                seed: int = 0) -> Path:
    """``folder/model.onnx`` (+ ``model.onnx.data``), written on first use, one tensor at a time."""
    path = folder / "model.onnx"
    if path.exists():
        return path
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    inits, nodes, h = [], [], "x"
    with open(tmp / "model.onnx.data", "wb") as f:
        for i in range(layers):
            up, down, transposed = f"layers.{i}.up", f"layers.{i}.down", i % 2 == 1 and not plain
            inits.append(_tensor(f, up, (hidden, ffn), dtype, rng, "model.onnx.data"))
            inits.append(_tensor(f, down, (hidden, ffn) if transposed else (ffn, hidden), dtype, rng,
                                 "model.onnx.data"))
            nodes += [helper.make_node("MatMul", [h, up], [f"{up}.out"]),
                      helper.make_node("Relu", [f"{up}.out"], [f"{up}.act"])]
            if transposed:
                nodes.append(helper.make_node("Transpose", [down], [f"{down}.t"], perm=[1, 0]))
            h = "y" if i == layers - 1 else f"h{i}"
            nodes.append(helper.make_node("MatMul", [f"{up}.act", f"{down}.t" if transposed else down], [h]))
            if sys.stderr.isatty():
                print(f"\rwriting {folder.name}: {i + 1}/{layers} blocks", end="", file=sys.stderr, flush=True)
    elem = helper.np_dtype_to_tensor_dtype(dtype)
    graph = helper.make_graph(nodes, "mlp_stack", [helper.make_tensor_value_info("x", elem, [1, hidden])],
                              [helper.make_tensor_value_info("y", elem, [1, hidden])], initializer=inits)
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp / "model.onnx"))
    print(f"\nwrote {path}", file=sys.stderr)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return path


def dist_runtime_command() -> list[str]:
    script = Path(sys.executable).with_name("dist-runtime")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from dist_runtime.cli import main; sys.exit(main())"]


#: Runs its arguments and prints [exit code, the child's peak RSS in bytes, its stderr's end].  A
#: child's ``ru_maxrss`` also counts the process it was forked from, so the command runs under
#: this small process rather than under the benchmark (which holds numpy and onnx).
WRAPPER = ("import json, resource, subprocess, sys; p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, "
           "stderr=subprocess.PIPE, text=True); r = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss; "
           "print(json.dumps([p.returncode, r * 1024, p.stderr[-1500:]]))")


def measured(argv: list[str]) -> tuple[int, float]:
    """Run ``argv``: (its peak resident memory in bytes, seconds), or raise with its stderr."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", WRAPPER, *argv], capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    code, rss, err = json.loads(out.stdout)
    if code:
        raise RuntimeError(f"{' '.join(argv[-5:])} failed ({code}): {err}")
    return rss, seconds


def convert_row(model: Path, out: Path, dtype: str | None, keep: bool) -> dict:
    inits = onnx.load(str(model), load_external_data=False).graph.initializer
    largest = max(int({e.key: e.value for e in t.external_data}["length"]) for t in inits)
    argv = [*dist_runtime_command(), "convert", str(model), "-o", str(out), "-q"]
    if dtype:
        argv += ["--dtype", dtype]
    try:
        rss, seconds = measured(argv)
        written = out.stat().st_size
    finally:
        if not keep:
            out.unlink(missing_ok=True)
    source = model.with_name("model.onnx.data").stat().st_size
    return {"source": source, "tensors": len(inits), "largest": largest, "rss": rss, "target": GIB + largest,
            "seconds": seconds, "written": written}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/dist-runtime-bench").expanduser(),
                    help="where the ONNX models are written once (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=16, help="MLP blocks, two weights each (default: 16)")
    ap.add_argument("--hidden", type=int, default=3072, help="(default: 3072)")
    ap.add_argument("--ffn", type=int, default=8192, help="(default: 8192)")
    ap.add_argument("--dtype", choices=("f32", "f16"), default="f32", help="weights' type in the ONNX file")
    ap.add_argument("--plain", action="store_true", help="no Transpose nodes: every weight stored as read")
    ap.add_argument("--convert-dtype", default=None, help="--dtype given to convert (default: as stored)")
    ap.add_argument("--out", type=Path, default=None, help="where the .model goes (default: beside the model)")
    ap.add_argument("--keep", action="store_true", help="keep the converted .model")
    args = ap.parse_args()

    dtype = np.dtype(np.float32 if args.dtype == "f32" else np.float16)
    need = 2 * args.layers * args.hidden * args.ffn * dtype.itemsize
    free = shutil.disk_usage(args.cache if args.cache.exists() else Path.home()).free
    rows = []
    for layers in (1, args.layers):
        folder = args.cache / f"onnx-mlp-{layers}x{args.hidden}x{args.ffn}-{args.dtype}{'-plain' * args.plain}"
        if not (folder / "model.onnx").exists() and free < 2.2 * need:
            sys.exit(f"{free / GIB:.1f} GiB free under {args.cache}: the model and its conversion need "
                     f"~{2 * need / GIB:.1f} GiB")
        model = write_model(folder, layers, args.hidden, args.ffn, dtype, args.plain)
        out = (args.out or folder) / f"converted-{layers}.model"
        rows.append((f"convert, {layers} block(s)", convert_row(model, out, args.convert_dtype, args.keep)))

    print(f"\n{'what':22} {'external data':>14} {'tensors':>8} {'largest':>10} {'peak RSS':>10} "
          f"{'1 GiB + largest':>16} {'s':>6}")
    for what, r in rows:
        print(f"{what:22} {r['source'] / GIB:10.2f} GiB {r['tensors']:8} {r['largest'] / MIB:6.0f} MiB "
              f"{r['rss'] / MIB:6.0f} MiB {r['target'] / MIB:12.0f} MiB {r['seconds']:6.1f}")
    (_, base), (_, full) = rows
    print(f"\npeak RSS of the {args.layers}-block conversion minus the 1-block one: "
          f"{round((full['rss'] - base['rss']) / MIB):+d} MiB (largest tensor {full['largest'] / MIB:.0f} MiB); "
          f"written {full['written'] / GIB:.2f} GiB{' (then deleted)' * (not args.keep)}")


if __name__ == "__main__":
    main()

"""Memory at real scale: a Llama-3.2-3B-shaped model beside llama.cpp on the same GGUF files.

The model: hidden 3072, 28 layers, 24 heads, 8 KV heads, FFN 8192, vocab 128256, tied embeddings,
context 8192 -- Llama-3.2-3B's shapes -- with random Q8_0 weights (random codes and scales, written
block by block: no float weights are ever held), 3.4 GB, and a Q4_K_M file made from it by
llama.cpp's own quantizer (``--q4``).  Both are written once into ``--cache``
(default ``~/.cache/dist-runtime-bench``) and reused.

Measured, each in a child process of its own (peak resident memory from ``wait4``'s ``ru_maxrss``):

- ``convert`` of the GGUF to a ``.model`` file;
- ``generate`` in one process: a 16-token prompt, ``--tokens`` new tokens, ``--max-context``;
- llama.cpp (llama-cpp-python) on the same GGUF: the same prompt and tokens at ``n_ctx`` =
  ``--max-context``, 2 threads;
- ``partition`` of the converted model under the budgets of the memory issue, fit or not, and
  the largest context that fits where it does not;
- the 3 x 3 GiB plan of 8 sessions of 4096 tokens (F16 KV caches) run on three stage actors of
  this machine: each stage's peak resident memory (its own report) against its budget.

Run as (a first run writes the model, a few minutes)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

#: Llama-3.2-3B's shapes.
SHAPE = {"hidden": 3072, "layers": 28, "heads": 24, "kv_heads": 8, "ffn": 8192, "vocab": 128256, "context": 8192}
PROMPT = list(range(1, 17))
GIB = 2**30


def _tensors(s: dict) -> list[tuple[str, tuple[int, ...], bool]]:
    """(GGUF name, shape [rows, cols], Q8_0?) in llama.cpp's order; tied: no ``output.weight``."""
    head = s["hidden"] // s["heads"]
    out = [("token_embd.weight", (s["vocab"], s["hidden"]), True)]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (s["hidden"],), False),
                (b + "attn_q.weight", (s["hidden"], s["hidden"]), True),
                (b + "attn_k.weight", (s["kv_heads"] * head, s["hidden"]), True),
                (b + "attn_v.weight", (s["kv_heads"] * head, s["hidden"]), True),
                (b + "attn_output.weight", (s["hidden"], s["hidden"]), True),
                (b + "ffn_norm.weight", (s["hidden"],), False),
                (b + "ffn_gate.weight", (s["ffn"], s["hidden"]), True),
                (b + "ffn_up.weight", (s["ffn"], s["hidden"]), True),
                (b + "ffn_down.weight", (s["hidden"], s["ffn"]), True)]
    return out + [("output_norm.weight", (s["hidden"],), False)]


def _q8_0_rows(rng, rows: int, cols: int, std: float = 0.02) -> np.ndarray:
    """Random Q8_0 blocks ``[rows, cols / 32 * 34]``: an f16 scale, then 32 int8 codes uniform in
    [-127, 127], so that the weights have standard deviation ``std``."""
    blocks = np.empty((rows, cols // 32, 34), np.uint8)
    blocks[..., :2] = np.full((rows, cols // 32, 1), std * 3**0.5 / 127, np.float16).view(np.uint8)
    blocks[..., 2:] = rng.integers(-127, 128, (rows, cols // 32, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_q8_0_gguf(path: Path, s: dict = SHAPE, seed: int = 0) -> Path:
    """The model as a Q8_0 GGUF, tensor by tensor (at most one in memory)."""
    import gguf

    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    head = s["hidden"] // s["heads"]
    w.add_name("bench-llama-3b-shaped")
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_rope_dimension_count(head)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(s["vocab"] - 3)])
    w.add_token_scores([-float(i) for i in range(s["vocab"])])
    w.add_token_types([2, 3, 3] + [1] * (s["vocab"] - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    Q = gguf.GGMLQuantizationType
    tensors = _tensors(s)
    for name, shape, q in tensors:
        if q:
            w.add_tensor_info(name, (shape[0], shape[1] // 32 * 34), np.dtype(np.uint8),
                              shape[0] * shape[1] // 32 * 34, raw_dtype=Q.Q8_0)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for i, (name, shape, q) in enumerate(tensors):
        w.write_tensor_data(_q8_0_rows(rng, *shape) if q else np.ones(shape, np.float32))
        if sys.stderr.isatty():
            print(f"\rwriting {path.name}: {i + 1}/{len(tensors)} tensors", end="", file=sys.stderr, flush=True)
    print(f"wrote {path}", file=sys.stderr)
    w.close()
    tmp.rename(path)
    return path


def model_files(cache: Path, q4: bool) -> dict[str, Path]:
    """The GGUF files, written on first use."""
    cache.mkdir(parents=True, exist_ok=True)
    files = {"Q8_0": cache / "llama-3b-shaped-q8_0.gguf"}
    if not files["Q8_0"].exists():
        write_q8_0_gguf(files["Q8_0"])
    if q4:
        files["Q4_K_M"] = cache / "llama-3b-shaped-q4_k_m.gguf"
        if not files["Q4_K_M"].exists():
            sys.path.insert(0, str(Path(__file__).parent))
            from bench_decode import quantize_with_llama_cpp

            print("quantizing to Q4_K_M with llama.cpp ...", file=sys.stderr)
            tmp = files["Q4_K_M"].with_suffix(".partial")
            if quantize_with_llama_cpp(files["Q8_0"], tmp) is None:
                del files["Q4_K_M"]
            else:
                tmp.rename(files["Q4_K_M"])
    return files


LLAMA_CHILD = """
import json, sys
from llama_cpp import Llama
path, n_ctx, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=2, n_threads_batch=2, verbose=False)
llm.eval(list(range(1, 17)))
for _ in range(tokens):
    llm.eval([5])  # the step's cost does not depend on which token
"""


def measured(argv: list[str]) -> tuple[int, float, str]:
    """Run ``argv``: (its peak RSS in bytes, seconds, its output's end), or raise with its
    stderr.  ``ru_maxrss`` of RUSAGE_CHILDREN is the largest of every child so far, so each
    command runs under a wrapper process of its own, which reports its one child's."""
    wrapper = ("import json, os, resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, "
               "text=True); r = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss; "
               "print(json.dumps([p.returncode, r * 1024, p.stdout[-4000:], p.stderr[-4000:]]))")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", wrapper, *argv], capture_output=True, text=True, check=True)
    code, rss, stdout, stderr = json.loads(out.stdout)
    if code:
        raise RuntimeError(f"{Path(argv[0]).name} {argv[1] if len(argv) > 1 else ''} failed ({code}): "
                           f"{stderr.strip()[-1500:]}")
    return rss, time.perf_counter() - t0, stdout + stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/dist-runtime-bench").expanduser(),
                    help="where the model files are written once and kept (default: %(default)s)")
    ap.add_argument("--max-context", type=int, default=8192, help="context of generate and llama.cpp's n_ctx")
    ap.add_argument("--tokens", type=int, default=16, help="new tokens after the 16-token prompt")
    ap.add_argument("--q4", action="store_true", help="also a Q4_K_M file made by llama.cpp's quantizer")
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--no-pipeline", action="store_true", help="leave out the 3 x 3 GiB plan's run on stage actors")
    args = ap.parse_args()
    bin_ = Path(sys.executable).parent / "dist-runtime"
    files = model_files(args.cache, args.q4)
    rows = []
    for kind, gguf_path in files.items():
        model = gguf_path.with_suffix(".model")
        rss, secs, _ = measured([str(bin_), "convert", str(gguf_path), "-o", str(model), "-q"])
        rows.append((f"convert {kind} ({gguf_path.stat().st_size / GIB:.2f} GiB)", rss, secs, None))
        ids = ",".join(map(str, PROMPT))
        rss, secs, _ = measured([str(bin_), "generate", str(model), "--ids", ids, "-n", str(args.tokens),
                                 "--max-context", str(args.max_context), "--ignore-eos", "--show-ids"])
        theirs = None
        if not args.no_llama_cpp:
            try:
                theirs, _, _ = measured([sys.executable, "-c", LLAMA_CHILD, str(gguf_path), str(args.max_context),
                                         str(args.tokens)])
            except RuntimeError as e:
                print(f"llama.cpp: {e}", file=sys.stderr)
        rows.append((f"generate {kind}, n_ctx {args.max_context}, 16 + {args.tokens} tokens", rss, secs, theirs))
    print(f"\n{'what':58} {'ours peak RSS':>14} {'s':>7} {'llama.cpp':>10} {'ours / llama.cpp':>17}")
    for what, rss, secs, theirs in rows:
        ratio = f"{rss / theirs:.2f}x" if theirs else "-"
        ref = f"{theirs / GIB:.2f} GiB" if theirs else "-"
        print(f"{what:58} {rss / GIB:10.2f} GiB {secs:7.1f} {ref:>10} {ratio:>17}")
    model = files["Q8_0"].with_suffix(".model")
    print("\npartition of the Q8_0 model:")
    for budgets, sessions, context, kv in PLANS:
        p = subprocess.run([str(bin_), "partition", str(model), "--budgets", budgets, "--sessions", str(sessions),
                            "--max-context", str(context), "--kv-dtype", kv], capture_output=True, text=True)
        said = (p.stdout if p.returncode == 0 else p.stderr).strip().splitlines()
        verdict = "fits" if p.returncode == 0 else "refused: " + (said[-1] if said else f"exit {p.returncode}")
        print(f"  {budgets:>16} x {sessions:2} sessions x {context:5}, {kv} KV: {verdict[:150]}")
    if not args.no_pipeline:
        run_plan(bin_, model, args.tokens)


#: (budgets, sessions, context, KV element type) of the memory issue's plans.
PLANS = (("5GiB", 1, 8192, "f32"), ("3GiB,3GiB,3GiB", 8, 4096, "f32"), ("3GiB,3GiB,3GiB", 8, 4096, "f16"),
         ("3GiB,3GiB,3GiB", 16, 4096, "f16"), ("3GiB,3GiB,3GiB", 16, 4096, "q8_0"),
         ("2GiB,2GiB,2GiB", 4, 2048, "f32"))


def run_plan(bin_: Path, model: Path, tokens: int) -> None:
    """The 3 x 3 GiB plan of 8 sessions of 4096 tokens (F16 KV) run for real on stage actors of
    this machine: each stage's peak resident memory against its budget."""
    ids = ",".join(map(str, PROMPT))
    out = subprocess.run([str(bin_), "generate", str(model), "--budgets", "3GiB,3GiB,3GiB", "--sessions", "8",
                          "--max-context", "4096", "--kv-dtype", "f16", "--ids", ids, "-n", str(tokens),
                          "--ignore-eos", "--json"], capture_output=True, text=True)
    if out.returncode:
        print(f"\nthe 3 x 3 GiB plan run: failed ({out.returncode}): {out.stderr.strip()[-800:]}")
        return
    memory = json.loads(out.stdout)["pipeline"]["memory"]
    print(f"\nthe 3 x 3 GiB plan run for real (8 sessions, 16 + {tokens} tokens, F16 KV, budgets 3.00 GiB):")
    for k, m in enumerate(memory):
        print(f"  stage {k}: peak resident {m['peak'] / GIB:.2f} GiB (weights {m['weights'] / GIB:.2f}, "
              f"KV reserved {m['kv_reserved'] / GIB:.3f}; planned {m['plan']['total'] / GIB:.2f} GiB)")


if __name__ == "__main__":
    main()

"""Decode tokens/s of the GraphExecutor next to PyTorch eager (transformers) and llama.cpp
(llama-cpp-python), on the same random ~125M-parameter Llama, measured in one run.

The model: hidden 768, 12 layers, 12 heads, 4 KV heads, FFN 2048, vocab 32000 (the executor
issue's benchmark model), seeded random weights with Hugging Face names, so the very same tensors
load into ``transformers.LlamaForCausalLM``.  Each engine: a 16-token prompt, then ``--tokens``
greedy decode steps; the median step time over ``--repeat`` runs.  Ours runs as a user gets it
(the default backends: numba's compiled small ops and products, then the CPU library), once more on
the CPU library alone, to show what the compiled ops are worth, on Q8_0 weights (with Q8_0
activations, the default numerics, and with f32 ones, ``--numerics f32``), and on a Q4_K_M GGUF made from the F32 one by llama.cpp's own quantizer
(``llama_model_quantize``) and converted by our importer, next to llama.cpp on the same file.  The
ratios to llama.cpp on the same weights are printed (of the medians, round by round, and from short
blocks of steps, ours and llama.cpp's alternating: :func:`paired_speed`; the machine's speed moves
whole runs by up to 1.7x from one minute to the next), and the time of a step of 8 rows (the products' M = 8) over a 1-row step, ours and llama.cpp's (F32 and Q8_0,
the logits of every row computed, as 8 sessions sharing a step need).  Also printed: the decode step
at context 1024 next to the step at context 32 (the KV cache must keep it flat), and the
executor's per-token Python overhead (time per token minus the time spent inside kernels).  The
two step ratios are medians of paired measurements, the two steps alternating (this machine is
shared: load from elsewhere moves a median by up to 30% from one minute to the next).

Run as (see the OPENBLAS trap in shared/notes/performance.md: unset both for this command only)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_decode.py

torch/transformers and llama-cpp-python are not project dependencies: install them to get their
columns (``pip install torch==2.13.0 transformers``; llama-cpp-python builds llama.cpp from source,
6-20 minutes here: ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON -DGGML_AVX512=OFF" pip install llama-cpp-python``.  Where the CPU has AVX-512 (some
of these machines do), a build with it is no faster here, and a native build's AMX path crashes
decoding the Q8_0 file (llama-cpp-python 0.3.36), so the published figures use this AVX2 build.  llama.cpp
reads the weights from GGUF files (F32 and Q8_0) written here with the ``gguf`` package exactly as
llama.cpp's own converter writes them (the tests' writer, ``tests/test_gguf_import.py``); the
first decode step's logits are compared with ours to show it runs the same model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from dist_runtime.dtypes import DType
from dist_runtime.examples import LlamaConfig, llama_graph, llama_weights
from dist_runtime.executor import GraphExecutor
from dist_runtime.ir import Graph, TensorSpec
from dist_runtime.tensor import QuantizedArray
from dist_runtime.kernels.quant import quantize

CFG = LlamaConfig(vocab=32000, hidden=768, layers=12, heads=12, kv_heads=4, ffn=2048)
PROMPT = np.arange(1, 17)


def our_executor(weights, fuse: bool, backends=None) -> GraphExecutor:
    """The executor as a user gets it (``backends=None``: numba, then the CPU library)."""
    g = llama_graph(CFG)
    specs = {n: TensorSpec(w.shape, w.dtype if isinstance(w, QuantizedArray) else DType.from_numpy(w.dtype))
             for n, w in weights.items()}
    return GraphExecutor((Graph(g.nodes, g.inputs, g.outputs, specs), weights), backends, fuse=fuse)


class Stepper:
    """One engine's greedy decode a step at a time: :meth:`start` runs the prompt, :meth:`step`
    one token and returns its seconds (``prompt()`` returns the prompt's last logits, ``token(t)``
    feeds ``t`` and returns the next logits)."""

    def __init__(self, prompt, token):
        self.prompt, self.token, self.next = prompt, token, 0

    def start(self) -> None:
        self.next = int(np.argmax(self.prompt()))

    def step(self) -> float:
        t = time.perf_counter()
        self.next = int(np.argmax(self.token(self.next)))
        return time.perf_counter() - t

    def run(self, tokens: int) -> list[float]:
        self.start()
        return [self.step() for _ in range(tokens)]


def ours_stepper(ex: GraphExecutor) -> Stepper:
    def prompt():
        ex.reset()
        return ex.run({"tokens": PROMPT})["logits"][-1]
    return Stepper(prompt, lambda tok: ex.run({"tokens": [tok]})["logits"][-1])


#: :func:`paired_speed`'s blocks: steps an engine runs in a row, and the first ones of them left
#: untimed.  llama.cpp's threads spin for ~10 ms after a step (its process uses ~10 ms of CPU in
#: the 10 ms after one): alternating single steps would leave ours a core short for most of each
#: of its steps (f32 0.79-0.85x round by round where whole runs measure 0.86-1.03x), and sleeping
#: that out between steps would send llama.cpp's threads to sleep before each of their own steps,
#: which in a generation they never do.
BLOCK, SETTLE = 6, 2


def paired_speed(ours: Stepper, theirs: Stepper, tokens: int, repeat: int) -> tuple[float, list[float]]:
    """Our speed relative to ``theirs`` from blocks of :data:`BLOCK` steps, the two engines'
    blocks alternating (each block's first :data:`SETTLE` steps untimed): (median over every pair
    of blocks of their median steps' ratio, each run's median).  A burst of load from elsewhere on
    this shared machine, which moves whole runs by up to 1.7x here, then hits both sides of a pair
    alike."""
    runs = []
    for _ in range(repeat):
        ours.start()
        theirs.start()
        ratios = []
        for i in range(max(1, tokens // BLOCK)):
            times = {}
            for side in (ours, theirs) if i % 2 else (theirs, ours):
                steps = [side.step() for _ in range(BLOCK)]
                times[side] = statistics.median(steps[SETTLE:])
            ratios.append(times[theirs] / times[ours])
        runs.append(ratios)
    return statistics.median(r for run in runs for r in run), [statistics.median(run) for run in runs]


def kernel_share(ex: GraphExecutor, tokens: int) -> tuple[float, float]:
    """(median seconds per decode token, median seconds of it inside kernels), by timing every
    bound kernel during decode steps only (the prompt runs untimed); the compiled program's step
    (``GraphExecutor.program``) counts as one kernel."""
    spent = [0.0]

    def timed(fn):
        def call(inputs, ctx):
            t = time.perf_counter()
            out = fn(inputs, ctx)
            spent[0] += time.perf_counter() - t
            return out
        return call

    ex.reset()
    tok = int(ex.run({"tokens": PROMPT})["logits"][-1].argmax())
    field = "_program_steps" if ex._program_steps else "_steps"  # the steps a decode step runs
    original = list(getattr(ex, field))
    setattr(ex, field, [replace(s, fn=timed(s.fn)) for s in original])
    totals, inside = [], []
    try:
        for _ in range(tokens):
            spent[0] = 0.0
            t = time.perf_counter()
            tok = int(ex.run({"tokens": [tok]})["logits"][-1].argmax())
            totals.append(time.perf_counter() - t)
            inside.append(spent[0])
    finally:
        setattr(ex, field, original)
    return statistics.median(totals), statistics.median(inside)


def torch_decoder(weights):
    """A function timing one decode run of transformers' LlamaForCausalLM on ``weights``, or None
    when torch/transformers are not installed."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    torch.set_num_threads(2)
    config = transformers.LlamaConfig(
        vocab_size=CFG.vocab, hidden_size=CFG.hidden, num_hidden_layers=CFG.layers,
        num_attention_heads=CFG.heads, num_key_value_heads=CFG.kv_heads, intermediate_size=CFG.ffn,
        rms_norm_eps=CFG.eps, rope_theta=CFG.rope_base, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict({n: torch.from_numpy(w) for n, w in weights.items()}, strict=True)

    def run(tokens: int) -> list[float]:
        steps = []
        with torch.inference_mode():
            out = model(torch.from_numpy(PROMPT)[None], use_cache=True)
            past, tok = out.past_key_values, out.logits[0, -1].argmax()
            for _ in range(tokens):
                t = time.perf_counter()
                out = model(tok.view(1, 1), past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[0, -1].argmax()
                steps.append(time.perf_counter() - t)
        return steps

    return run


def write_gguf_files(weights, directory: Path) -> dict[str, Path]:
    """The model as GGUF, F32 and Q8_0, through the tests' convert_hf_to_gguf-equivalent writer."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gguf import GGMLQuantizationType as Q
    from test_gguf_import import SPM, write_gguf

    cfg = {"max_position_embeddings": 2048, "hidden_size": CFG.hidden, "num_hidden_layers": CFG.layers,
           "intermediate_size": CFG.ffn, "head_dim": CFG.hidden // CFG.heads,
           "num_attention_heads": CFG.heads, "num_key_value_heads": CFG.kv_heads,
           "rms_norm_eps": CFG.eps, "vocab_size": CFG.vocab}
    vocab = SPM + [f"t{i}" for i in range(CFG.vocab - len(SPM))]
    meta = {"llama.rope.freq_base": float(CFG.rope_base), "tokenizer.ggml.tokens": vocab,
            "tokenizer.ggml.scores": [0.0] * CFG.vocab,
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * (CFG.vocab - 259)}
    return {name: write_gguf(directory / f"bench-{name}.gguf", q, weights=weights, cfg=cfg, meta=meta)
            for name, q in (("f32", Q.F32), ("q8_0", Q.Q8_0))}


def quantize_with_llama_cpp(source: Path, out: Path, ftype: str = "Q4_K_M") -> Path | None:
    """``source`` (a GGUF) requantized by llama.cpp's own quantizer, as people make Q4_K_M files;
    None when llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    params.allow_requantize = True  # a Q8_0 source, as the memory benchmark's
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {ftype}")
    return out


def gguf_executor(path: Path, directory: Path, backends=None) -> GraphExecutor:
    """A GGUF file converted by our importer (tensors kept as stored), as an executor."""
    from dist_runtime.importers import convert
    from dist_runtime.model import load_model

    out = convert(path, directory / (path.stem + ".model")).out
    return GraphExecutor(load_model(out), backends)


def rows_ratio(ex: GraphExecutor, rows: int, context: int = 32, runs: int = 9) -> tuple[float, float, float]:
    """A step over ``rows`` new rows after ``context`` rows, against a step of one row (``rows`` = 8:
    the products' M = 8, what a batched step of 8 sessions asks of them): (median seconds of one
    row, of ``rows``, median of the paired ratios: :func:`paired_steps`).  Every row's logits are
    computed, as each session of a batched step needs its own."""
    def step(n: int) -> float:
        ex.reset()
        ex.run({"tokens": np.arange(context) % CFG.vocab})
        t = time.perf_counter()
        ex.run({"tokens": np.arange(n) % CFG.vocab})
        return time.perf_counter() - t
    return paired_steps(step, rows, runs)


def paired_steps(step, rows: int, runs: int = 9) -> tuple[float, float, float]:
    """``step(n)`` (the seconds of a step of ``n`` new rows) at 1 and ``rows``, alternating run by
    run, so that a burst of load from elsewhere on this shared machine hits both: (median seconds
    of one row, of ``rows``, median of the paired ratios)."""
    one, many = [], []
    for _ in range(runs):
        one.append(step(1))
        many.append(step(rows))
    return statistics.median(one), statistics.median(many), statistics.median(b / a for a, b in zip(one, many))


def llama_cpp_rows_ratio(path: Path, rows: int, context: int = 32) -> tuple[float, float, float] | None:
    """:func:`rows_ratio` for llama.cpp on ``path``: a step of ``rows`` tokens after ``context``,
    every row's logits computed (``logits_all``), as each of 8 sessions in a batched step needs its
    own (by default llama.cpp computes the last row's alone); None without llama-cpp-python."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_ctx=256, n_threads=2, n_threads_batch=2, n_batch=64,
                logits_all=True, verbose=False)

    def step(n: int) -> float:
        llm.reset()
        llm.eval([int(t) for t in np.arange(context) % CFG.vocab])
        t = time.perf_counter()
        llm.eval([int(t) for t in np.arange(n) % CFG.vocab])
        return time.perf_counter() - t
    try:
        return paired_steps(step, rows)
    finally:
        llm.close()


def llama_cpp_decoder(path: Path) -> tuple[Stepper | None, np.ndarray | None]:
    """llama.cpp on ``path`` as a :class:`Stepper`, and the logits of the prompt's last position;
    None when llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None, None
    llm = Llama(model_path=str(path), n_ctx=256, n_threads=2, n_threads_batch=2, n_batch=64,
                verbose=False)

    def last_logits() -> np.ndarray:
        # Without logits_all, llama-cpp-python keeps no scores: read the context's last row.
        return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(CFG.vocab,))

    def prompt():
        llm.reset()
        llm.eval([int(t) for t in PROMPT])
        return last_logits()

    def token(tok):
        llm.eval([tok])
        return last_logits()

    return Stepper(prompt, token), prompt().copy()


def context_ratio(ex: GraphExecutor, steps: int = 24) -> tuple[float, float, float]:
    """Decode steps at context 32 and at 1024, as two sessions of ``ex`` whose single steps
    alternate (a burst of load from elsewhere then hits both): (median seconds at 32, at 1024,
    median of the paired ratios)."""
    ex.reset()
    for session, ctx in (("short", 32), ("long", 1024)):
        ex.run({"tokens": np.arange(ctx) % CFG.vocab}, session=session)
    times: dict[str, list[float]] = {"short": [], "long": []}
    for i in range(steps):
        for session in ("short", "long") if i % 2 == 0 else ("long", "short"):
            t = time.perf_counter()
            ex.run({"tokens": [i]}, session=session)
            times[session].append(time.perf_counter() - t)
    for session in times:
        ex.close_session(session)
    short, long = times["short"], times["long"]
    return statistics.median(short), statistics.median(long), statistics.median(b / a for a, b in zip(short, long))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per run (default 32)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per engine (default 3)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave the llama.cpp columns out")
    args = parser.parse_args()

    w = llama_weights(CFG, seed=0)
    q8 = {n: quantize(a, DType.Q8_0) if a.ndim == 2 and a.shape[-1] % 32 == 0 else a for n, a in w.items()}
    rows = []

    def add(name, per_run):
        per_run = [r for r in per_run if r]
        if not per_run:
            rows.append((name, None))
            return
        rows.append((name, statistics.median(statistics.median(r) for r in per_run)))

    ours = {"ours f32 (fused)": our_executor(w, True),
            "ours f32 (unfused)": our_executor(w, False),
            "ours f32 (CPU library)": our_executor(w, True, ["cpu"]),
            "ours Q8_0 (f32 activations)": our_executor(q8, True, ["numba-f32"]),
            "ours Q8_0 (q8 activations, the default)": our_executor(q8, True)}
    tmp = tempfile.TemporaryDirectory()
    files = {} if args.no_llama_cpp else write_gguf_files(w, Path(tmp.name))
    if files and quantize_with_llama_cpp(files["f32"], Path(tmp.name) / "bench-q4_k_m.gguf"):
        files["q4_k_m"] = Path(tmp.name) / "bench-q4_k_m.gguf"
        ours["ours Q4_K_M (f32 activations)"] = gguf_executor(files["q4_k_m"], Path(tmp.name), ["numba-f32"])
        ours["ours Q4_K_M (q8 activations, the default)"] = gguf_executor(files["q4_k_m"], Path(tmp.name))
    steppers = {name: ours_stepper(ex) for name, ex in ours.items()}
    engines = {name: (lambda st=st: st.run(args.tokens)) for name, st in steppers.items()}
    torch_run = torch_decoder(w)
    engines["PyTorch eager f32"] = (lambda: torch_run(args.tokens)) if torch_run else (lambda: None)
    ours_logits = our_executor(w, False).run({"tokens": PROMPT})["logits"][-1]
    agreement = {}
    for name, path in files.items():
        stepper, logits = llama_cpp_decoder(path)
        steppers[f"llama.cpp {name.upper()}"] = stepper
        engines[f"llama.cpp {name.upper()}"] = (lambda st=stepper: st.run(args.tokens)) if stepper else (lambda: None)
        if logits is not None:
            agreement[name] = float(np.abs(logits - ours_logits).max() / np.abs(ours_logits).max())
    # Rounds interleave the engines, so that a burst of load from elsewhere on this shared
    # machine hits all of them rather than one.
    runs: dict[str, list] = {name: [] for name in engines}
    for _ in range(args.repeat):
        for name, run in engines.items():
            runs[name].append(run())
    for name in engines:
        add(name, runs[name])

    ref = dict(rows).get("PyTorch eager f32")
    cpp = dict(rows).get("llama.cpp F32")
    print(f"decode, {CFG.layers} layers x hidden {CFG.hidden}, prompt {len(PROMPT)}, {args.tokens} steps, median of {args.repeat}")
    print(f"{'engine':<32} {'ms/token':>9} {'tok/s':>8} {'vs PyTorch':>11} {'vs llama.cpp F32':>17}")
    for name, sec in rows:
        if sec is None:
            print(f"{name:<32} {'(not installed)':>30}")
            continue
        ratio = f"{ref / sec:.2f}x" if ref else "-"
        ratio_cpp = f"{cpp / sec:.2f}x" if cpp else "-"
        print(f"{name:<32} {sec * 1e3:9.2f} {1 / sec:8.1f} {ratio:>11} {ratio_cpp:>17}")
    for name, err in agreement.items():
        print(f"llama.cpp {name.upper()} vs ours f32, logits of the prompt's last position: max |diff| / max |logit| = {err:.1e}")
    timed = dict(rows)
    for ours_name, theirs in (("ours f32 (fused)", "llama.cpp F32"),
                              ("ours Q8_0 (f32 activations)", "llama.cpp Q8_0"),
                              ("ours Q8_0 (q8 activations, the default)", "llama.cpp Q8_0"),
                              ("ours Q4_K_M (f32 activations)", "llama.cpp Q4_K_M"),
                              ("ours Q4_K_M (q8 activations, the default)", "llama.cpp Q4_K_M")):
        if timed.get(ours_name) and timed.get(theirs):
            # Each round's own ratio too: the two ran seconds apart, under the same load.
            rounds = ", ".join(f"{statistics.median(t) / statistics.median(o):.2f}"
                               for o, t in zip(runs[ours_name], runs[theirs]) if o and t)
            print(f"{ours_name} / {theirs}: {timed[theirs] / timed[ours_name]:.2f}x llama.cpp's speed "
                  f"(round by round: {rounds})")
            paired, per_run = paired_speed(steppers[ours_name], steppers[theirs], args.tokens, args.repeat)
            print(f"  in alternating blocks of {BLOCK} steps: {paired:.2f}x (each run: {', '.join(f'{r:.2f}' for r in per_run)})")
    for name in ("ours f32 (fused)", "ours Q8_0 (f32 activations)", "ours Q8_0 (q8 activations, the default)"):
        one, eight, paired = rows_ratio(ours[name], 8)
        print(f"{name}: a step of 8 rows takes {paired:.2f}x the time of 1 row (median of paired runs; "
              f"medians {eight * 1e3:.2f} / {one * 1e3:.2f} ms)")
    for name in ("f32", "q8_0"):
        measured = llama_cpp_rows_ratio(files[name], 8) if name in files else None
        if measured:
            one, eight, paired = measured
            print(f"llama.cpp {name.upper()}: a step of 8 rows (the logits of all 8) takes {paired:.2f}x the time "
                  f"of 1 row (medians {eight * 1e3:.2f} / {one * 1e3:.2f} ms)")

    per_token, in_kernels = kernel_share(ours["ours f32 (fused)"], args.tokens)
    print(f"\nper-token Python overhead (fused f32): {(per_token - in_kernels) * 1e3:.2f} ms of "
          f"{per_token * 1e3:.2f} ms ({100 * (1 - in_kernels / per_token):.0f}%), "
          f"{len(ours['ours f32 (fused)'].graph.nodes)} nodes; program: {ours['ours f32 (fused)'].program}")
    for name in ("ours f32 (fused)",):
        c32, c1024, paired = context_ratio(ours[name])
        print(f"{name}: decode step at context 1024 / context 32: {paired:.2f}x (median of paired steps; "
              f"medians {c1024 * 1e3:.2f} / {c32 * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()

"""Prefill of long prompts at real scale, beside llama.cpp on the same GGUF files: the time to the
first token of a 512- and a 2048-token prompt on the Llama-3.2-3B-shaped model of
``bench_memory.py`` (random Q8_0 weights, and the Q4_K_M file llama.cpp's quantizer makes of them),
one session, 2 threads each.

Ours runs as ``dist-runtime generate`` does (``GraphExecutor`` with the default backends and
numerics, F16 KV caches, ``LocalEngine``: one idle session's prompt goes in passes of 512 rows);
llama.cpp as llama-cpp-python's ``Llama.eval`` does (``n_batch`` 512, ``n_ubatch`` 512).  Each
engine runs in a child process of its own, first a short prompt (compiling, loading the weights
into memory), then ``--repeat`` timed prompts of each length; medians.

Run as (see the OPENBLAS trap in shared/notes/performance.md)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_prefill.py --q4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_memory import model_files  # noqa: E402

OURS_CHILD = """
import json, sys, time
from dist_runtime.engine import LocalEngine, generate
from dist_runtime.executor import GraphExecutor
from dist_runtime.scheduling import Request
from dist_runtime.sampling import Sampling
model, lengths, repeat, kv = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4]
ex = GraphExecutor(model, kv_dtype=kv)
engine = LocalEngine(ex)
def ttft(n, tag):
    prompt = [1 + (7 * i) % 1000 for i in range(n)]
    req = Request(session=tag, prompt=prompt, max_new_tokens=1, sampling=Sampling.from_options(greedy=True))
    return generate(engine, [req]).sessions[0].first_token_seconds
ttft(32, "warm")
print(json.dumps({n: [ttft(n, f"{n}-{i}") for i in range(repeat)] for n in lengths}))
"""

LLAMA_CHILD = """
import json, sys, time
from llama_cpp import Llama
path, lengths, repeat = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=max(lengths) + 16, n_batch=512, n_ubatch=512, n_threads=2,
            n_threads_batch=2, verbose=False)
def ttft(n):
    llm.reset()
    prompt = [1 + (7 * i) % 1000 for i in range(n)]
    t0 = time.perf_counter()
    llm.eval(prompt)
    return time.perf_counter() - t0
ttft(32)
print(json.dumps({n: [ttft(n) for _ in range(repeat)] for n in lengths}))
"""


def child(code: str, *argv: str) -> dict[int, list[float]]:
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr.strip()[-1500:])
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/dist-runtime-bench").expanduser(),
                    help="where bench_memory.py's model files are written once and kept (default: %(default)s)")
    ap.add_argument("--lengths", default="512,2048", help="prompt lengths, comma-separated (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=1, help="timed prompts of each length (default: %(default)s)")
    ap.add_argument("--q4", action="store_true", help="also the Q4_K_M file made by llama.cpp's quantizer")
    ap.add_argument("--only", choices=("Q8_0", "Q4_K_M"), help="one of the files only")
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--kv-dtype", default="f16", choices=("f16", "f32", "q8_0"),
                    help="what our KV caches keep (default: %(default)s, as generate's; llama.cpp's: f16)")
    args = ap.parse_args()
    bin_ = Path(sys.executable).parent / "dist-runtime"
    files = model_files(args.cache, args.q4 or args.only == "Q4_K_M")
    rows = []
    for kind, gguf_path in files.items():
        if args.only and kind != args.only:
            continue
        model = gguf_path.with_suffix(".model")
        if not model.exists():
            subprocess.run([str(bin_), "convert", str(gguf_path), "-o", str(model), "-q"], check=True)
        ours = child(OURS_CHILD, str(model), args.lengths, str(args.repeat), args.kv_dtype)
        theirs = None
        if not args.no_llama_cpp:
            try:
                theirs = child(LLAMA_CHILD, str(gguf_path), args.lengths, str(args.repeat))
            except RuntimeError as e:
                print(f"llama.cpp: {e}", file=sys.stderr)
        for n, times in ours.items():
            mine = statistics.median(times)
            ref = statistics.median(theirs[n]) if theirs else None
            rows.append((kind, n, mine, ref))
            print(f"{kind} {n}: ours {mine:.1f} s" + (f", llama.cpp {ref:.1f} s" if ref else ""), file=sys.stderr)
    print(f"\n{'weights':8} {'prompt':>7} {'ours s':>8} {'tok/s':>7} {'llama.cpp s':>12} {'tok/s':>7} {'speed ratio':>12}")
    for kind, n, mine, ref in rows:
        tail = f"{ref:12.1f} {n / ref:7.1f} {ref / mine:11.2f}x" if ref else f"{'-':>12} {'-':>7} {'-':>12}"
        print(f"{kind:8} {n:7} {mine:8.1f} {n / mine:7.1f} {tail}")


if __name__ == "__main__":
    main()

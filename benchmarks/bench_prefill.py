"""Prefill of long prompts at real scale, beside llama.cpp on the same GGUF files: the time to the
first token of a 512- and a 2048-token prompt on the Llama-3.2-3B-shaped model of
``bench_memory.py`` (random Q8_0 weights, and the Q4_K_M file llama.cpp's quantizer makes of them),
one session, 2 threads each; and, at that scale, the decode speed of ``--decode`` greedy tokens
after a 16-token prompt (median of ``--repeat`` runs; ``bench_decode.py`` measures the 125M model's
decode more finely).

Ours runs as ``dist-runtime generate`` does (``GraphExecutor`` with the default backends and
numerics, F16 KV caches, ``LocalEngine``: one idle session's prompt goes in passes of 512 rows);
llama.cpp as llama-cpp-python's ``Llama.eval`` does (``n_batch`` 512, ``n_ubatch`` 512).  Each
engine runs in a child process of its own, first an untimed prompt of :data:`WARM` tokens
(compiling, loading the weights into memory), then ``--repeat`` timed prompts of each length;
medians.

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
model, lengths, repeat, kv, decode = (sys.argv[1], [int(n) for n in sys.argv[2].split(",")], int(sys.argv[3]),
                                      sys.argv[4], int(sys.argv[5]))  # argv[6]: WARM
ex = GraphExecutor(model, kv_dtype=kv)
engine = LocalEngine(ex)
def ttft(n, tag):
    prompt = [1 + (7 * i) % 1000 for i in range(n)]
    req = Request(session=tag, prompt=prompt, max_new_tokens=1, sampling=Sampling.from_options(greedy=True))
    return generate(engine, [req]).sessions[0].first_token_seconds
ttft(int(sys.argv[6]), "warm")
times = {n: [ttft(n, f"{n}-{i}") for i in range(repeat)] for n in lengths}
if decode:
    greedy = Sampling.from_options(greedy=True)
    runs = [generate(engine, [Request(f"d{i}", list(range(1, 17)), decode + 1, greedy)]).sessions[0]
            for i in range(repeat)]
    times[0] = [r.tokens_per_second for r in runs]
print(json.dumps(times))
"""

LLAMA_CHILD = """
import json, sys, time
from llama_cpp import Llama
path, lengths, repeat, decode = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=max(lengths + [int(sys.argv[5])]) + 16, n_batch=512, n_ubatch=512, n_threads=2,
            n_threads_batch=2, verbose=False)
def ttft(n):
    llm.reset()
    prompt = [1 + (7 * i) % 1000 for i in range(n)]
    t0 = time.perf_counter()
    llm.eval(prompt)
    return time.perf_counter() - t0
ttft(int(sys.argv[5]))
times = {n: [ttft(n) for _ in range(repeat)] for n in lengths}
def tokens_per_second():
    llm.reset()
    llm.eval(list(range(1, 17)))
    t0 = time.perf_counter()
    for _ in range(decode):
        llm.eval([5])  # a step's cost does not depend on which token
    return decode / (time.perf_counter() - t0)
if decode:
    times[0] = [tokens_per_second() for _ in range(repeat)]
print(json.dumps(times))
"""


#: The untimed first prompt of each engine: longer than a row's first piece of keys
#: (``attention_pieces.SPLIT_KEYS``), so that it takes every path a long prompt takes.  After a
#: 32-token one, on a cold kernel cache, the first 512-token prompt still paid ~5 s of compiling.
WARM = 300


def child(code: str, *argv: str) -> dict[int, list[float]]:
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr.strip()[-1500:])
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def lengths(text: str) -> str:
    """``--lengths``: positive token counts, comma-separated (checked here, not in the children)."""
    try:
        ns = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token counts such as 512,2048, got {text!r}") from None
    if any(n < 1 for n in ns):
        raise argparse.ArgumentTypeError(f"token counts must be at least 1, got {text!r}")
    return ",".join(map(str, ns))


def count(text: str) -> int:
    """A whole number (``--decode``, ``--repeat``; their ranges are checked after parsing)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/dist-runtime-bench").expanduser(),
                    help="where bench_memory.py's model files are written once and kept (default: %(default)s)")
    ap.add_argument("--lengths", type=lengths, default="512,2048", help="prompt lengths, comma-separated (default: %(default)s)")
    ap.add_argument("--repeat", type=count, default=1, help="timed prompts of each length (default: %(default)s)")
    ap.add_argument("--q4", action="store_true", help="also the Q4_K_M file made by llama.cpp's quantizer")
    ap.add_argument("--only", choices=("Q8_0", "Q4_K_M"), help="one of the files only")
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--decode", type=count, default=32, help="greedy tokens of the decode measurement (0: none; "
                    "default: %(default)s)")
    ap.add_argument("--kv-dtype", default="f16", choices=("f16", "f32", "q8_0"),
                    help="what our KV caches keep (default: %(default)s, as generate's; llama.cpp's: f16)")
    args = ap.parse_args()
    if args.repeat < 1 or args.decode < 0:
        ap.error(f"--repeat takes 1 or more and --decode 0 or more, got {args.repeat} and {args.decode}")
    bin_ = Path(sys.executable).parent / "dist-runtime"
    files = model_files(args.cache, args.q4 or args.only == "Q4_K_M")
    rows, decodes = [], []
    for kind, gguf_path in files.items():
        if args.only and kind != args.only:
            continue
        model = gguf_path.with_suffix(".model")
        if not model.exists():
            subprocess.run([str(bin_), "convert", str(gguf_path), "-o", str(model), "-q"], check=True)
        ours = child(OURS_CHILD, str(model), args.lengths, str(args.repeat), args.kv_dtype, str(args.decode), str(WARM))
        theirs = None
        if not args.no_llama_cpp:
            try:
                theirs = child(LLAMA_CHILD, str(gguf_path), args.lengths, str(args.repeat), str(args.decode), str(WARM))
            except RuntimeError as e:
                print(f"llama.cpp: {e}", file=sys.stderr)
        for n, times in ours.items():
            mine = statistics.median(times)
            ref = statistics.median(theirs[n]) if theirs else None
            (decodes if n == 0 else rows).append((kind, n, mine, ref))
    print(f"\n{'weights':8} {'prompt':>7} {'ours s':>8} {'tok/s':>7} {'llama.cpp s':>12} {'tok/s':>7} {'speed ratio':>12}")
    for kind, n, mine, ref in rows:
        tail = f"{ref:12.1f} {n / ref:7.1f} {ref / mine:11.2f}x" if ref else f"{'-':>12} {'-':>7} {'-':>12}"
        print(f"{kind:8} {n:7} {mine:8.1f} {n / mine:7.1f} {tail}")
    if decodes:
        print(f"\ndecode, {args.decode} tokens after 16: tokens/s")
        print(f"{'weights':8} {'ours':>8} {'llama.cpp':>10} {'speed ratio':>12}")
        for kind, _, mine, ref in decodes:
            print(f"{kind:8} {mine:8.2f} " + (f"{ref:10.2f} {mine / ref:11.2f}x" if ref else f"{'-':>10} {'-':>12}"))


if __name__ == "__main__":
    main()

"""Structured output's cost: decode time per token of 8 sessions under a JSON schema's grammar
(dist_runtime/grammar.py, llguidance) against the same sessions unconstrained, on the ~125M random
Llama of bench_batching.py (F32) with a byte-level vocabulary padded to its 32000 logits.

Each session: a 3-token prompt, 32 tokens sampled at temperature 1 (seeded), the schema an object
of one 40-character string (so the grammar never ends a session early); rounds alternate the two
runs; the median time per token of each and their ratio (target: the grammar <= 10% of decode).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_grammar.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40, "maxLength": 40}},
          "required": ["s"], "additionalProperties": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()

    from bench_batching import CFG, model_files
    from test_structured_output import EOS, byte_level_tokenizer

    from dist_runtime.engine import LocalEngine, Request, generate
    from dist_runtime.executor import GraphExecutor
    from dist_runtime.grammar import Constraint, GrammarTokenizer
    from dist_runtime.sampling import Sampling

    ex = GraphExecutor(model_files(args.dir)["F32"])
    tokenizer = GrammarTokenizer(byte_level_tokenizer(args.dir / "bench-byte-tokenizer.json").read_text(),
                                 CFG.vocab, [EOS])

    def per_token(tag: str, constrained: bool) -> float:
        reqs = [Request(f"{tag}{i}", [5, 6, 7 + i], 32, Sampling(temperature=1.0, seed=i), frozenset({EOS}),
                        constraint=Constraint.json(tokenizer, SCHEMA) if constrained else None)
                for i in range(args.sessions)]
        start = time.perf_counter()
        out = generate(LocalEngine(ex), reqs)
        return (time.perf_counter() - start) / sum(len(v) for v in out.tokens.values())

    per_token("warm", True)
    times = {False: [], True: []}
    for r in range(args.rounds):
        for constrained in (False, True):
            times[constrained].append(per_token(f"{r}{constrained}", constrained))
    free, bound = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.sessions} sessions, 125M Llama F32, median of {args.rounds} alternating rounds")
    print("| sampling | ms per token | against free |")
    print("|---|---|---|")
    print(f"| free | {1e3 * free:.3f} | 1.00x |")
    print(f"| JSON schema grammar | {1e3 * bound:.3f} | {bound / free:.3f}x |")
    print(f"grammar cost {100 * (bound / free - 1):.1f}% of decode (target <= 10%)")


if __name__ == "__main__":
    main()

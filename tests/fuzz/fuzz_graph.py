"""atheris: the graph readers on arbitrary bytes -- the canonical binary form (decode_graph) and
the TOML form (graph_from_toml); the first input byte chooses which.

    python tests/fuzz/fuzz_graph.py -atheris_runs=100000 [-rss_limit_mb=2048] [corpus_dir]

Only ModelFormatError may escape; what decodes must re-encode canonically (tests/fuzz/oracle.py).
"""

import sys

import _common
from _common import oracle

_count = 0


def test_one(data: bytes) -> None:
    global _count
    _count += 1
    # The seeds are whole graphs of either form: tell them apart by their first byte (a TOML
    # graph starts with text, a binary one with a little-endian u32 node count).
    target = "graph_from_toml" if data[:1].isascii() and data[:1].isalpha() else "decode_graph"
    if _count % 64 == 0:
        oracle.check_memory(target, data)
    else:
        oracle.CHECKS[target](data)


if __name__ == "__main__":
    s = oracle.seeds()
    _common.run("graph", test_one, sys.argv, seeds=s["decode_graph"] + s["graph_from_toml"])

"""atheris: transport.decode_message on arbitrary bytes.

    python tests/fuzz/fuzz_transport.py -atheris_runs=100000 [-rss_limit_mb=2048] [corpus_dir]

Only TransportError may escape, a message that decodes gives well-formed read-only arrays, and
every 64th input is also checked against the memory bound (tests/fuzz/oracle.py)."""

import sys

import _common
from _common import oracle

_count = 0


def test_one(data: bytes) -> None:
    global _count
    _count += 1
    if _count % 64 == 0:
        oracle.check_memory("decode_message", data)
    else:
        oracle.check_transport(data)


if __name__ == "__main__":
    _common.run("decode_message", test_one, sys.argv)

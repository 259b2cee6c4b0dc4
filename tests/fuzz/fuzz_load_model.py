"""atheris: load_model on arbitrary file contents.

    python tests/fuzz/fuzz_load_model.py -atheris_runs=100000 [-rss_limit_mb=2048] [corpus_dir]

Each input is written to a new file in a RAM directory (/dev/shm when there is one) and loaded:
only ModelFormatError and GraphValidationError may escape, and what loads must satisfy the
loader's invariants (tests/fuzz/oracle.py)."""

import os
import sys
import tempfile
from pathlib import Path

import _common
from _common import oracle

_DIR = Path(tempfile.mkdtemp(prefix="fuzz-load-model-",
                             dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
_count = 0


def test_one(data: bytes) -> None:
    global _count
    _count += 1
    path = _DIR / f"f{_count}.model"
    try:
        if _count % 64 == 0:
            oracle.check_memory("load_model", data, path)
        else:
            oracle.check_load_model(data, path)
    finally:
        path.unlink(missing_ok=True)  # a new name per input; the old mapping is closed by now


if __name__ == "__main__":
    _common.run("load_model", test_one, sys.argv)

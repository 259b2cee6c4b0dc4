"""Every bad invocation fails fast and clearly: one line naming the problem, a non-zero exit, no
traceback, no hang, nothing left behind (no Ray process, no temporary file).

The cases run in one child process (what a user's shell runs, with the package's real imports and
signal handlers), each through ``dist_runtime.cli.main``; the child reports per case the exit
status, what went to stderr, the seconds taken and whether Ray was started.  Cases that need no
Ray must not start it: that is what keeps them instant.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import PIPELINE_CFG, save_example
from dist_runtime.examples import LlamaConfig

pytestmark = pytest.mark.slow  # a child process, some cases start Ray

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"

#: (id, argv, extra environment, exit status, words the last line of stderr holds).  {names} are
#: files made below; no case needs a cluster (the one "refused" address is a closed local port).
NO_RAY = [
    ("missing model", ["generate", "{dir}/nope.model", "--ids", "1", "--stages", "2"], {}, 1, "cannot open"),
    ("truncated model", ["pipeline", "{truncated}", "--stages", "2"], {}, 1, "ModelFormatError"),
    ("budgets abc", ["pipeline", "{tiny}", "--budgets", "abc"], {}, 1, "is not a size"),
    ("speeds 0", ["pipeline", "{tiny}", "--stages", "2", "--speeds", "0,1"], {}, 1, "speed"),
    ("too many stages", ["pipeline", "{tiny}", "--stages", "100"], {}, 1, "100 stages were requested"),
    ("too many sessions", ["pipeline", "{tiny}", "--stages", "2", "--sessions", "100000"], {}, 1,
     "a stage holds at most 4096 sessions"),
    ("an encoder", ["pipeline", "{bert}", "--stages", "2"], {}, 1, "use `dist-runtime embed`"),
    ("timeline unwritable", ["pipeline", "{tiny}", "--stages", "2", "--timeline", "{dir}/no/such/t.svg"], {}, 1,
     "--timeline"),
    ("plan not JSON", ["pipeline", "{tiny}", "--plan", "{notjson}"], {}, 1, "is not JSON"),
    ("plan truncated", ["pipeline", "{tiny}", "--plan", "{truncplan}"], {}, 1, "is not JSON"),
    ("plan of another model", ["pipeline", "{tiny}", "--plan", "{otherplan}"], {}, 1, "made for another graph"),
    ("address not an address", ["pipeline", "{tiny}", "--stages", "2", "--address", "notahost"], {}, 1,
     "is not a cluster address"),
    ("address of the jobs API", ["pipeline", "{tiny}", "--stages", "2", "--address", "http://127.0.0.1:1"], {}, 1,
     "jobs API"),
    ("RAY_ADDRESS of the jobs API", ["generate", "{tiny}", "--ids", "1", "--stages", "2"],
     {"RAY_ADDRESS": "http://127.0.0.1:8265"}, 1, "unset RAY_ADDRESS"),
    ("nothing listens", ["pipeline", "{tiny}", "--stages", "2", "--address", "127.0.0.1:1"], {}, 1,
     "cannot reach the Ray cluster at 127.0.0.1:1"),
    ("no cluster for auto", ["pipeline", "{tiny}", "--stages", "2", "--address", "auto"],
     {"RAY_TMPDIR": "{dir}"}, 1, "no Ray cluster was started on this machine"),
    ("prompt beyond --max-context", ["pipeline", "{tiny}", "--stages", "2", "--prompt-ids", "1,2,3",
                                      "--max-context", "2"], {}, 1, "exceed the context length 2"),
    ("context overflow", ["partition", "{tiny}", "--stages", "2", "--max-context", "100000000000000000"], {}, 1,
     "beyond what any machine holds"),
    ("convert into a directory", ["convert", str(FIXTURES / "llama"), "-o", "{dir}"], {}, 1, "is a directory"),
    ("example without layers", ["example", "-o", "{dir}/x.model", "--layers", "0"], {}, 2, "must be at least 1"),
    ("negative deadline", ["pipeline", "{tiny}", "--stages", "2", "--connect-timeout", "-1"], {}, 2,
     "must be a finite number above 0"),
    ("no rows a pass", ["generate", "{tiny}", "--ids", "1", "--max-batch-tokens", "0"], {}, 2, "must be at least 1"),
    ("no micro-batch", ["pipeline", "{tiny}", "--stages", "2", "--micro-batches", "0"], {}, 2, "must be at least 1"),
    ("trace unwritable", ["pipeline", "{tiny}", "--stages", "2", "--trace", "{dir}/no/such/t.json"], {}, 1, "--trace"),
    ("serve on no port", ["serve", "{tiny}", "--port", "70000"], {}, 2, "must be at most 65535"),
    ("serve on no address", ["serve", "{tiny}", "--host", "256.1.1.1", "--port", "0"], {}, 1,
     "cannot listen on 256.1.1.1:0"),
]
NEEDS_RAY = [
    ("more CPUs than a node has", ["pipeline", "{tiny}", "--stages", "2", "--cpus-per-stage", "4",
                                   "--num-cpus", "2"], {}, 1, "asks for 4 CPU"),
    ("resources no node has", ["pipeline", "{tiny}", "--stages", "2", "--num-cpus", "2",
                               "--stage-resources", "gpu_node,gpu_node2"], {}, 1, "no node has it"),
]

DRIVER = textwrap.dedent("""
    import contextlib, io, json, os, sys, time
    from dist_runtime.cli import main

    for case in json.loads(sys.stdin.read()):
        for name in ("RAY_ADDRESS", "RAY_TMPDIR"):
            os.environ.pop(name, None)
        os.environ.update(case["env"])
        err = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(case["argv"])
            except SystemExit as e:
                code = e.code
        ray = sys.modules.get("ray")
        print(json.dumps({"id": case["id"], "code": code, "err": err.getvalue(),
                          "seconds": time.perf_counter() - t0, "ray_left": bool(ray and ray.is_initialized())}),
              flush=True)
""")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    from dist_runtime.importers import convert

    d = tmp_path_factory.mktemp("bad")
    tiny = save_example(d / "tiny.model", PIPELINE_CFG)
    other = save_example(d / "other.model", LlamaConfig(vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64))
    (d / "truncated.model").write_bytes(Path(tiny).read_bytes()[:5000])
    (d / "notjson.json").write_text("stages: 2\n")
    subprocess.run([sys.executable, "-m", "dist_runtime.cli", "partition", str(other), "--stages", "2",
                    "-o", str(d / "other.json")], check=True, capture_output=True, timeout=120)
    (d / "trunc.json").write_text((d / "other.json").read_text()[:300])
    bert = convert(FIXTURES / "bert", d / "bert.model").out
    return {"dir": str(d), "tiny": str(tiny), "truncated": str(d / "truncated.model"), "bert": str(bert),
            "notjson": str(d / "notjson.json"), "truncplan": str(d / "trunc.json"), "otherplan": str(d / "other.json")}


def _run(cases, files) -> dict[str, dict]:
    payload = [{"id": i, "argv": [a.format(**files) for a in argv], "env": {k: v.format(**files) for k, v in env.items()}}
               for i, argv, env, _, _ in cases]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(payload), capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return {r["id"]: r for r in map(json.loads, out.stdout.splitlines())}


def _check(cases, results) -> None:
    for case_id, _, _, code, words in cases:
        r = results[case_id]
        lines = [line for line in r["err"].splitlines() if line.strip()]
        assert r["code"] == code, (case_id, r)
        assert lines and words in lines[-1], (case_id, r["err"][-2000:])
        assert "Traceback" not in r["err"], (case_id, r["err"][-3000:])
        assert not r["ray_left"], case_id


def test_bad_invocations_that_need_no_ray_fail_at_once(files):
    before = sorted(os.listdir(files["dir"]))
    results = _run(NO_RAY, files)
    assert sorted(os.listdir(files["dir"])) == before  # no temporary or partial file left
    _check(NO_RAY, results)
    for case_id, _, _, code, _ in NO_RAY:
        if code == 1:  # the problem, in one line ("error: Kind: message")
            assert len([x for x in results[case_id]["err"].splitlines() if x.strip()]) == 1, results[case_id]
    slow = {i: round(r["seconds"], 2) for i, r in results.items() if r["seconds"] > 10}
    assert not slow, f"these waited: {slow}"  # (measured: each well under 1 s; see the note)


def test_requests_no_node_can_place_are_refused_without_waiting(files):
    results = _run(NEEDS_RAY, files)
    _check(NEEDS_RAY, results)
    slow = {i: round(r["seconds"], 1) for i, r in results.items() if r["seconds"] > 60}
    assert not slow, f"these waited: {slow}"  # an embedded Ray starts in ~5 s; placement is not awaited

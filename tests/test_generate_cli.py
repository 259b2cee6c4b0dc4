"""``dist-runtime generate``: streaming, greedy against transformers' tokens, seeded sampling, EOS,
text prompts through the converted tokenizer, usage errors.  Uses the Llama fixture of
tests/fixtures/hf (see test_hf_import.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dist_runtime.cli import main
from dist_runtime.executor import GraphExecutor

pytest.importorskip("safetensors")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"


@pytest.fixture(scope="module")
def ref() -> dict:
    with np.load(FIXTURES / "llama.npz") as f:
        return {k: f[k].tolist() for k in ("prompt", "tokens")}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from dist_runtime.importers.hf.llama import convert_hf

    return str(convert_hf(FIXTURES / "llama", tmp_path_factory.mktemp("gen") / "llama.model").out)


def ids(values) -> str:
    return ",".join(map(str, values))


def generate(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main(["generate", *map(str, argv)])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_greedy_ids_are_transformers_tokens(model, ref, capsys):
    code, out, err = generate(capsys, model, "--ids", ids(ref["prompt"]), "-n", 32, "--show-ids", "--ignore-eos")
    assert code == 0
    assert [int(t) for t in out.split()] == ref["tokens"]
    assert "prompt 8 tokens" in err and "generated 32 tokens" in err and "tokens/s" in err


def test_tokens_are_streamed_as_they_come(model, ref, capsys, monkeypatch):
    """Before each decode step runs, every token picked so far is already on stdout."""
    seen = []
    run = GraphExecutor.run

    def spy(self, inputs, **kw):
        seen.append(capsys.readouterr().out)  # what was printed since the previous run
        return run(self, inputs, **kw)

    monkeypatch.setattr(GraphExecutor, "run", spy)
    assert main(["generate", model, "--ids", ids(ref["prompt"]), "-n", "6", "--show-ids", "--ignore-eos"]) == 0
    tail = capsys.readouterr().out
    # run 0 is the prefill (nothing printed yet); run i follows the i-th token
    assert seen[0] == "" and [s.strip() for s in seen[1:]] == [str(t) for t in ref["tokens"][:5]]
    assert tail.strip() == str(ref["tokens"][5]) and len(seen) == 6  # no run after the last token


def test_text_prompt_through_the_tokenizer(model, ref, capsys):
    pytest.importorskip("tokenizers")
    from dist_runtime.importers.tokenizer import Tokenizer

    prompt = " ".join(f"w{t}" for t in ref["prompt"])
    code, out, _ = generate(capsys, model, "--prompt", prompt, "-n", 32, "--ignore-eos")
    assert code == 0
    tok = Tokenizer(FIXTURES / "llama" / "tokenizer.json")
    assert tok.encode(prompt) == ref["prompt"]
    assert out == tok.decode(ref["tokens"]) + "\n"
    assert out.startswith(f"w{ref['tokens'][0]} w{ref['tokens'][1]} ")


def test_seeded_sampling_is_reproducible(model, ref, capsys):
    args = [model, "--ids", ids(ref["prompt"]), "-n", 24, "--show-ids", "--ignore-eos", "--temperature", 1.5]
    runs = [generate(capsys, *args, "--seed", seed)[1] for seed in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    sampled = [int(t) for t in runs[0].split()]
    assert len(sampled) == 24 and sampled != ref["tokens"][:24] and all(0 <= t < 128 for t in sampled)
    # top-k 1 keeps only the most likely token: greedy again, whatever the temperature
    _, out, _ = generate(capsys, *args, "--seed", 3, "--top-k", 1)
    assert [int(t) for t in out.split()] == ref["tokens"][:24]
    _, out, _ = generate(capsys, *args, "--seed", 3, "--top-p", 0.9, "--min-p", 0.05)
    assert len(out.split()) == 24


def test_json_output(model, ref, capsys):
    pytest.importorskip("tokenizers")
    code, out, _ = generate(capsys, model, "--ids", ids(ref["prompt"]), "-n", 5, "--json")
    assert code == 0
    result = json.loads(out)
    (session,) = result["sessions"]
    assert result["prompt"] == ref["prompt"] and session["ids"] == ref["tokens"][:5]
    assert session["text"] == " ".join(f"w{t}" for t in ref["tokens"][:5]) and session["finish_reason"] == "length"
    assert result["generated_tokens"] == 5 and result["tokens_per_second"] > 0 and result["pipeline"] is None
    assert session["first_token_seconds"] > 0 and session["tokens_per_second"] > 0


def test_sessions_in_one_process(model, ref, capsys):
    """``--sessions K`` without stages: K sessions from the prompt, seeds seed .. seed + K - 1,
    each as it would be alone."""
    argv = [model, "--ids", ids(ref["prompt"]), "-n", 6, "--ignore-eos", "--temperature", 1.3, "--json"]
    code, out, _ = generate(capsys, *argv, "--sessions", 3, "--seed", 10)
    together = json.loads(out)["sessions"]
    assert code == 0 and [s["seed"] for s in together] == [10, 11, 12]
    for s in together:
        _, out, _ = generate(capsys, *argv, "--seed", s["seed"])
        assert json.loads(out)["sessions"][0]["ids"] == s["ids"]
    _, out, _ = generate(capsys, model, "--ids", ids(ref["prompt"]), "-n", 4, "--sessions", 2, "--show-ids", "--ignore-eos")
    assert out.splitlines() == [f"session {i}: {','.join(map(str, ref['tokens'][:4]))}" for i in range(2)]


def test_stops_at_eos(ref, tmp_path, capsys):
    """eos_token_id comes from generation_config.json; generation stops after emitting it."""
    from dist_runtime.importers.hf.llama import convert_hf

    hf = Path(shutil.copytree(FIXTURES / "llama", tmp_path / "llama"))
    gen = json.loads((hf / "generation_config.json").read_text())
    (hf / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [ref["tokens"][2], 999]}))
    path = convert_hf(hf, tmp_path / "eos.model").out
    code, out, err = generate(capsys, path, "--ids", ids(ref["prompt"]), "-n", 32, "--show-ids")
    assert code == 0 and [int(t) for t in out.split()] == ref["tokens"][:3] and "stopped at EOS" in err


@pytest.mark.parametrize("argv, code, message", [
    (["--greedy", "--temperature", "0.7"], 2, "greedy contradicts temperature"),
    (["--temperature", "0", "--top-k", "5"], 2, "temperature 0 (greedy) contradicts top_k"),
    (["--top-p", "0"], 2, "top_p must be in (0, 1]"),
    (["--max-tokens", "-1"], 2, "argument -n/--max-tokens: -1 must be at least 1"),
    (["--ids", "1,x"], 2, "'1,x' is not a comma-separated list of token ids"),
    (["--ids", "1,500"], 1, "prompt id 500 is outside the vocabulary [0, 128)"),
    (["--ids", "1", "-n", "300"], 1, "1 prompt tokens + 300 new tokens exceed the context length 256"),
    (["--prompt", "w1", "--tokenizer", "/nonexistent/tokenizer.json"], 1, "no tokenizer at"),
])
def test_usage_errors(model, capsys, argv, code, message):
    if "--ids" not in argv and "--prompt" not in argv:
        argv = ["--ids", "1,2", *argv]
    got, _, err = generate(capsys, model, *argv)
    assert got == code and message in err


def test_text_prompt_needs_a_tokenizer(tmp_path, capsys):
    from dist_runtime.importers.hf.llama import convert_hf

    path = convert_hf(FIXTURES / "phi", tmp_path / "phi.model").out  # phi has no tokenizer.json
    code, _, err = generate(capsys, path, "--prompt", "hello")
    assert code == 1 and "has no tokenizer" in err and "--ids" in err


@pytest.mark.slow  # a CLI subprocess
def test_ctrl_c_stops_generate_cleanly(tmp_path):
    """SIGINT (Ctrl-C) during a long generation: exit status 130, a one-line note, no traceback,
    and the tokens printed so far stand."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import default_signals, save_example
    from dist_runtime.examples import LlamaConfig

    path = save_example(tmp_path / "m.model", LlamaConfig(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128))
    proc = subprocess.Popen([sys.executable, "-m", "dist_runtime.cli", "generate", str(path), "--ids", "1,2,3",
                             "-n", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=default_signals)
    try:
        first = proc.stdout.read(4)  # tokens are streaming
        assert first
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert proc.returncode == 130, err
    assert "dist-runtime generate: interrupted" in err and "Traceback" not in err
    assert len((first + out).split()) > 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed raise itself
def test_an_interrupt_lost_in_a_callback_is_raised_again_at_the_next_token():
    """numba compiling a kernel calls back into Python through ctypes, which prints a raise there
    as "Exception ignored" and drops it: the Ctrl-C must still stop the command, at the next
    token, and leave nothing pending once the command has answered it."""
    import ctypes

    from dist_runtime import commands

    callback = ctypes.CFUNCTYPE(None)(lambda: commands.raise_interrupted(2, None))
    callback()  # the KeyboardInterrupt is swallowed by ctypes, as in the lost Ctrl-C
    seen = []

    def command(args):
        seen.append("ran")
        commands.check_signals()  # what generate's per-token callback does
        seen.append("not reached")
        return 0

    import argparse
    assert commands.run_command(command, argparse.Namespace(command="generate")) == commands.INTERRUPTED
    assert seen == ["ran"] and not commands._pending
    commands.check_signals()  # nothing pending: no raise


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed raise itself
def test_an_error_an_interrupt_caused_is_the_interrupt(capsys):
    """A Ctrl-C during numba's compile is lost in its callback, and numba then fails with an error
    of its own (seen: RuntimeError "no compiled object yet"): the command ends as interrupted, in
    one line, not with that error's stack dump.  An error with no interrupt pending stays itself."""
    import argparse
    import ctypes

    from dist_runtime import commands

    def broken(args):
        ctypes.CFUNCTYPE(None)(lambda: commands.raise_interrupted(2, None))()
        raise RuntimeError("no compiled object yet")

    assert commands.run_command(broken, argparse.Namespace(command="generate")) == commands.INTERRUPTED
    assert capsys.readouterr().err == "\ndist-runtime generate: interrupted\n" and not commands._pending
    def failing(args):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        commands.run_command(failing, argparse.Namespace(command="generate"))


def test_a_lost_interrupt_prints_no_stack_dump_but_other_unraisables_do(capsys):
    import ctypes
    import sys

    from dist_runtime import commands

    before = sys.unraisablehook
    sys.unraisablehook = commands._quiet_lost_interrupts
    try:
        ctypes.CFUNCTYPE(None)(lambda: commands.raise_interrupted(2, None))()
        assert capsys.readouterr().err == ""
        commands._pending.clear()
        ctypes.CFUNCTYPE(None)(lambda: 1 / 0)()
        assert "ZeroDivisionError" in capsys.readouterr().err
    finally:
        sys.unraisablehook = before
        commands._pending.clear()

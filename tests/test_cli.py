"""The dist-runtime command line: inspect, validate, example; exit codes and --json."""

import json
import re
import subprocess
import sys

import pytest

from dist_runtime.cli import main
from dist_runtime.model import load_model


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_example_validate_inspect(tmp_path, capsys):
    path = tmp_path / "m.model"
    code, out, _ = run(capsys, "example", "-o", str(path), "--layers", "1", "--hidden", "32")
    assert code == 0 and "wrote" in out
    code, out, _ = run(capsys, "validate", str(path))
    assert code == 0 and out.startswith(f"OK: {path}: ") and "tensors" in out
    code, out, _ = run(capsys, "inspect", str(path))
    assert code == 0
    assert "model.layers.0.self_attn.q_proj.weight" in out
    assert "%l0_q = Matmul %l0_attn_in, model.layers.0.self_attn.q_proj.weight  # f32[-1,32]" in out
    assert "memory estimate" in out


def test_inspect_json(tmp_path, capsys):
    path = tmp_path / "m.model"
    run(capsys, "example", "-o", str(path), "--layers", "1")
    code, out, _ = run(capsys, "inspect", "--json", str(path))
    report = json.loads(out)
    with load_model(path) as m:
        assert [t["name"] for t in report["tensors"]] == list(m.index)
        assert report["graph"]["nodes"] == len(m.graph.nodes)
    assert report["graph"]["inputs"] == {"tokens": "i32[-1]"}
    assert report["memory"]["weights"] == sum(t["size"] for t in report["tensors"])
    assert code == 0 and report["warnings"] == []


def test_validate_fails_with_a_message_and_exit_1(tmp_path, capsys):
    path = tmp_path / "m.model"
    run(capsys, "example", "-o", str(path), "--layers", "1")
    data = bytearray(path.read_bytes())
    bad = tmp_path / "bad.model"
    bad.write_bytes(bytes(data[:200]))
    code, _, err = run(capsys, "validate", str(bad))
    assert code == 1 and err.startswith("error: ModelFormatError: ") and "truncated" in err
    code, out, _ = run(capsys, "validate", "--json", str(bad))
    assert code == 1 and json.loads(out)["valid"] is False


def test_memory_budget_flag(tmp_path, capsys):
    path = tmp_path / "m.model"
    run(capsys, "example", "-o", str(path), "--layers", "1")
    code, _, err = run(capsys, "validate", str(path), "--max-memory", "1KiB")
    assert code == 1 and "exceeds the declared maximum of 1,024 bytes" in err
    assert run(capsys, "validate", str(path), "--max-memory", "1GiB")[0] == 0


def test_missing_file_and_bad_size(tmp_path, capsys):
    code, _, err = run(capsys, "validate", str(tmp_path / "nope.model"))
    assert code == 1 and "cannot open" in err
    with pytest.raises(SystemExit) as e:
        main(["validate", "x.model", "--max-memory", "lots"])
    assert e.value.code == 2
    assert "is not a size" in capsys.readouterr().err


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "dist_runtime.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "inspect" in out.stdout and "validate" in out.stdout


def test_inspect_plan_lists_every_node_with_backend_and_reason(tmp_path, capsys):
    path = tmp_path / "m.model"
    run(capsys, "example", "-o", str(path), "--layers", "1")
    code, out, _ = run(capsys, "inspect", str(path), "--plan", "--no-fuse", "--json")
    plan = json.loads(out)["plan"]
    with load_model(path) as m:
        assert [p["id"] for p in plan] == [n.id for n in m.graph.nodes]
    reasons = {(p["op"], p["backend"], p["reason"]) for p in plan}
    assert code == 0 and {("Sdpa", "numba", "default"),
                          ("KvCache", "cpu", "default numba does not support it; fallback to cpu")} <= reasons
    # generation runs batch-invariant: an F32 product is the compiled one, not BLAS's
    assert any(p["op"] == "Matmul" and p["reason"].startswith("default; compiled product: F32 on ") for p in plan)
    rows = {p["op"]: p["rows"] for p in plan}
    assert (rows["Matmul"], rows["Rope"], rows["KvCache"], rows["Sdpa"]) == (
        "independent", "positional", "per-session", "per-session")
    assert json.loads(out)["batching"].startswith("the rows of several sessions share each pass")
    assert "MiB of streamed weights" in json.loads(out)["weights"]  # where the matrix weights live, and why
    code, out, _ = run(capsys, "inspect", str(path), "--plan", "--no-fuse", "--json", "--backends", "cpu")
    plan = json.loads(out)["plan"]
    assert code == 0 and all(p["backend"] == "cpu" and p["reason"] == "default" for p in plan)
    assert json.loads(out)["program"].startswith("no compiled program: node ")  # nothing compiled to run
    code, out, _ = run(capsys, "inspect", str(path), "--plan")
    assert code == 0 and "backend plan (batch-invariant" in out and "\nbatching: the rows of several" in out
    assert "\nprogram: " in out and " steps from node " in out  # the fused layer in one compiled call
    assert "\nlast rows: every row makes the outputs: node " in out  # its graph ends in a Sample node


def test_inspect_plan_says_which_compiled_product_runs_a_quantized_weight_and_why(tmp_path, capsys):
    """The CPU path (vector or portable) is chosen at import; the plan names it and its reason."""
    pytest.importorskip("numba")
    from dist_runtime.backends import compiled
    from dist_runtime.backends.compiled import cpu, threads
    from dist_runtime.dtypes import DType
    from dist_runtime.examples import LlamaConfig, llama_graph, llama_weights
    from dist_runtime.kernels.quant import quantize
    from dist_runtime.model import save_model

    cfg = LlamaConfig(vocab=64, hidden=64, layers=1, heads=4, kv_heads=2, ffn=128)
    weights = {n: quantize(w, DType.Q8_0) if n.endswith("proj.weight") else w for n, w in llama_weights(cfg).items()}
    save_model(tmp_path / "q8.model", llama_graph(cfg), weights, {}).close()
    machine = f"({cpu.REASON}; {threads.REASON})"
    for numerics, q8_acts in (("f32", "f32"), ("auto", "q8_0"), ("q8", "q8_0")):
        code, out, _ = run(capsys, "inspect", str(tmp_path / "q8.model"), "--plan", "--no-fuse", "--json",
                           "--numerics", numerics)
        reasons = {p["reason"] for p in json.loads(out)["plan"] if p["op"] == "Matmul"}
        assert code == 0
        for dtype, acts in ((DType.Q8_0, q8_acts), (DType.F32, "f32")):  # the projections; the lm_head
            route = compiled.route(dtype, acts)
            assert f"default; compiled product: {dtype.name} on {route.tile}, {acts} activations {machine}" in reasons


def test_generate_reports_its_memory(decoder_path, capsys):
    """--json carries the process's resident memory (now, peak) and its KV caches' bytes; --stats
    prints them."""
    import json

    assert main(["generate", str(decoder_path), "--ids", "1,2,3", "-n", "4", "--json", "--ignore-eos"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["peak"] >= memory["resident"] > 0
    assert 0 < memory["kv_in_use"] <= memory["kv_reserved"]
    assert main(["generate", str(decoder_path), "--ids", "1,2,3", "-n", "4", "--stats", "--show-ids"]) == 0
    assert re.search(r"^memory: resident .+ \(peak .+\), KV in use .+ of .+ reserved$", capsys.readouterr().out, re.M)

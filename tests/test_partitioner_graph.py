"""The partitioner on Graph IR graphs: the cost model, real Llama-architecture graphs, ordering,
errors a person can act on, the plan object, the CLI command and the SVG."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from dist_runtime.dtypes import DType
from dist_runtime.errors import DistRuntimeError, GraphValidationError, InfeasiblePlanError
from dist_runtime.examples import LlamaConfig, llama_graph, llama_metadata, llama_weights
from dist_runtime.ir.graph import Graph, Node, TensorSpec
from dist_runtime.ir.ops import Add, RmsNorm, TokenEmbed
from dist_runtime.partitioner.costs import CostModel
from dist_runtime.partitioner.graph_costs import graph_costs
from dist_runtime.partitioner.granularity import coarsen, layer_boundaries
from dist_runtime.partitioner.machines import Machine, make_machines
from dist_runtime.partitioner.plan import Plan
from dist_runtime.partitioner.planner import build_plan, partition
from dist_runtime.partitioner.solver import feasible, solve
from dist_runtime.partitioner.svg import plan_svg

ROOT = Path(__file__).resolve().parents[1]
CFG = LlamaConfig(vocab=256, hidden=64, layers=8, heads=4, kv_heads=2, ffn=128)


def weight_specs(cfg: LlamaConfig) -> dict[str, TensorSpec]:
    """The example's weight names and shapes, without generating its random weights."""
    one = llama_weights(LlamaConfig(**{**cfg.__dict__, "layers": 1}))
    specs = {}
    for name, w in one.items():
        copies = [name.replace("layers.0.", f"layers.{i}.") for i in range(cfg.layers)] if "layers.0." in name else [name]
        specs.update({copy: TensorSpec(w.shape, DType.F32) for copy in copies})
    return specs


def llama(cfg: LlamaConfig = CFG, *, tied: bool = False) -> Graph:
    """The example Llama graph with weight specs (what a loaded .model's graph carries)."""
    graph = llama_graph(cfg)
    specs = weight_specs(cfg)
    if tied:  # lm_head reuses the embedding table, as in many small models
        graph.nodes[-2].inputs[1] = "model.embed_tokens.weight"
        del specs["lm_head.weight"]
    graph.weights = specs
    graph.invalidate()
    return graph


def nbytes(graph: Graph, names) -> int:
    return sum(graph.weights[n].nbytes() for n in names)


# -- the cost model -----------------------------------------------------------------------------
def test_cost_model_of_a_llama_graph():
    g = llama(LlamaConfig(layers=2))
    costs = graph_costs(g, max_context=64, sessions=3, tokens=16)
    pos = {node.outputs[0]: i for i, node in enumerate(g.nodes)}
    # Matmul q: [16, 64] x [64, 64]^T -> 2 * 16 * 64 * 64 FLOPs.
    assert costs.compute[pos["l0_q"]] == 2 * 16 * 64 * 64
    # Sdpa: q [16, 64] against 64 cached keys (max context): 4 * 16*64 * 64 + 5 * 16 * 4 heads * 64.
    assert costs.compute[pos["l0_attn"]] == 4 * 16 * 64 * 64 + 5 * 16 * 4 * 64
    # KV cache: K and V, [max_context, kv_heads * head_dim] kept in f16 (the default), per session.
    kv_node = pos["l0_k_all"]
    assert costs.kv[kv_node] == 2 * 64 * 32 * 2 * 3
    assert costs.kv.sum() == 2 * costs.kv[kv_node]
    # Weights: every weight once, bytes from dtype x shape.
    assert set(costs.weight_names) == set(g.weights)
    assert costs.weight_bytes.sum() == nbytes(g, g.weights)
    # Activations: at the embedding, tokens (i32[16]) and h (f32[16, 64]) are live.
    assert costs.live[0] == 16 * 4 + 16 * 64 * 4
    # Attention holds what the compiled kernel allocates while it runs: each row's one piece (64
    # keys) of weighted values and statistics [heads, head_dim + 2] f32, one task's scratch.
    attn, t = pos["l0_attn"], costs.tensors
    held = int(t.act[(np.maximum(t.producer, 0) <= attn) & (np.minimum(t.last, costs.n - 1) >= attn)].sum())
    # one task's: a group of 4 rows' scores, exps' bits and sums
    assert costs.live[attn] == held + 16 * 4 * (16 + 2) * 4 + 4 * (64 * (4 * 4 + 1) + 4 * 4 * 16)
    # The cache's outputs are views (no activation memory) but cost bytes when they cross a cut.
    after_cache = pos["l0_k_all"] + 1
    assert "l0_k_all" in costs.tensors.crossing(after_cache)
    assert costs.cut[after_cache] >= 2 * 64 * 32 * 4


def test_microbatches_multiply_activations_only():
    g = llama(LlamaConfig(layers=1))
    one = graph_costs(g, max_context=32, tokens=8)
    two = graph_costs(g, max_context=32, tokens=8, microbatches=2)
    assert (two.live == 2 * one.live).all()
    assert (two.kv == one.kv).all() and (two.compute == one.compute).all() and (two.cut == one.cut).all()


def test_tensor_counted_once_across_a_cut_and_at_both_boundaries_when_it_skips_a_stage():
    w = {"E": TensorSpec((16, 8), DType.F32), "w1": TensorSpec((8,), DType.F32), "w2": TensorSpec((8,), DType.F32)}
    nodes = [
        Node(0, TokenEmbed(), ["tokens", "E"], ["h"]),
        Node(1, RmsNorm(), ["h", "w1"], ["a"]),
        Node(2, RmsNorm(), ["a", "w2"], ["b"]),
        Node(3, Add(), ["h", "b"], ["c"]),  # h skips nodes 1..2
        Node(4, Add(), ["c", "h"], ["d"]),  # and is consumed once more
    ]
    g = Graph(nodes, [TensorSpec((-1,), DType.I32)], ["d"], w)
    costs = graph_costs(g, max_context=4)
    h = 4 * 8 * 4  # f32[4, 8]
    # h crosses boundaries 1..4 once each, whatever its three consumers (networkx.cut_size would
    # count its edges); a, b and c each cross one boundary.
    assert costs.cut[1:5].tolist() == [h, 2 * h, 2 * h, 2 * h]
    assert costs.tensors.crossing(1) == ["h"] and costs.tensors.crossing(3) == ["h", "b"]
    plan = build_plan(costs, [Machine(name="m0"), Machine(name="m1"), Machine(name="m2")],
                      solve(costs, [Machine()] * 3))
    skipped = [s for s in plan.stages if "h" in s.tensors_in and "h" in s.tensors_out]
    assert skipped, "h is forwarded through the middle stage: counted at both its boundaries"
    assert plan.cut_bytes == sum(int(costs.cut[s.start]) for s in plan.stages[1:])


# -- real graphs ----------------------------------------------------------------------------------
def test_llama_splits_at_layer_boundaries_with_embedding_and_lm_head_accounted(tmp_path):
    from dist_runtime.model import load_model, save_model

    path = tmp_path / "llama.model"
    save_model(path, llama_graph(CFG), llama_weights(CFG), llama_metadata(CFG)).close()
    with load_model(path, tensors=[]) as model:
        machines = make_machines(budgets="4MiB,4MiB,4MiB,4MiB", speeds="1,2,1,1")
        plan = partition(model.graph, machines, max_context=256, sessions=4, tokens=16)
        graph = model.graph
    assert plan.request["granularity_used"] == "layer"
    ops = {node.id: node for node in graph.nodes}
    for stage in plan.stages[1:]:
        first = ops[stage.nodes[0]]
        # Each stage starts at a layer's first node (or at the final norm / lm_head), and only the
        # residual stream crosses the cut.
        assert first.op_name == "RmsNorm" or "lm_head.weight" in first.inputs, first
        assert len(stage.tensors_in) == 1 and stage.tensors_in[0].endswith("resid_mlp")
    assert "model.embed_tokens.weight" in plan.stages[0].weights
    last = plan.stages[-1]
    assert {"lm_head.weight", "model.norm.weight"} <= set(last.weights)
    for stage in plan.stages:
        m = stage.memory
        assert m.weights == nbytes(graph, stage.weights)  # each weight in its stage, once
        assert m.total <= m.budget
        layers = {w.split(".")[2] for w in stage.weights if w.startswith("model.layers.")}
        assert m.kv == len(layers) * 2 * 256 * 32 * 2 * 4  # K and V per layer in f16, 4 sessions
    assert sorted(w for s in plan.stages for w in s.weights) == sorted(graph.weights)
    assert plan.stages[1].compute > plan.stages[0].compute  # the speed-2 machine takes more


def test_auto_granularity_falls_back_to_nodes_when_budgets_forbid_layer_cuts():
    g = llama(LlamaConfig(layers=2))
    costs = graph_costs(g, max_context=64, tokens=8)
    coarse = coarsen(costs, layer_boundaries(costs))

    def smallest_budget(model: CostModel) -> int:
        lo, hi = 1, int(model.weight_bytes.sum() + model.kv.sum() + model.live.max())
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if feasible(model, [Machine(mid)] * 3) else (mid + 1, hi)
        return lo

    node_budget, layer_budget = smallest_budget(costs), smallest_budget(coarse)
    assert node_budget < layer_budget
    tight = partition(g, [Machine(node_budget)] * 3, max_context=64, tokens=8)
    roomy = partition(g, [Machine(layer_budget)] * 3, max_context=64, tokens=8)
    assert tight.request["granularity_used"] == "node"
    assert roomy.request["granularity_used"] == "layer"
    with pytest.raises(InfeasiblePlanError):
        partition(g, [Machine(node_budget)] * 3, max_context=64, tokens=8, granularity="layer")


def test_tied_embedding_counted_in_first_and_last_stage():
    g = llama(LlamaConfig(layers=2), tied=True)
    plan = partition(g, make_machines(stages=2), max_context=32, tokens=4, granularity="node")
    embed = "model.embed_tokens.weight"
    table = g.weights[embed].nbytes()
    first, last = plan.stages
    assert embed in first.weights and embed in last.weights
    assert first.memory.weights >= table and last.memory.weights >= table
    assert first.memory.weights + last.memory.weights == nbytes(g, g.weights) + table


def test_out_of_order_graph_is_ordered_by_networkx():
    g = llama(LlamaConfig(layers=1))
    q = next(i for i, n in enumerate(g.nodes) if n.outputs == ["l0_q"])
    g.nodes.append(g.nodes.pop(q))  # the q projection now comes after its consumer
    g.invalidate()
    plan = partition(g, make_machines(stages=2), max_context=16, tokens=4)
    position = {nid: k for k, nid in enumerate(plan.order)}
    for node in g.nodes:  # every producer before its consumers
        for name in node.inputs:
            for other in g.nodes:
                if name in other.outputs:
                    assert position[other.id] < position[node.id]
    assert list(plan.order) != [n.id for n in g.nodes]


def test_cycle_is_reported_with_find_cycle():
    w = {"w": TensorSpec((4,), DType.F32)}
    nodes = [
        Node(7, Add(), ["x", "b_out"], ["a_out"]),
        Node(8, Add(), ["a_out", "w"], ["b_out"]),
    ]
    g = Graph(nodes, [TensorSpec((4,), DType.F32)], ["b_out"], w)
    with pytest.raises(GraphValidationError) as e:
        partition(g, make_machines(stages=1), max_context=4)
    msg = str(e.value)
    assert "cycle" in msg and "node 7 (Add)" in msg and "node 8 (Add)" in msg and "a_out" in msg


def test_missing_weights_are_explained():
    g = llama_graph(LlamaConfig(layers=1))  # names its weights but carries no specs for them
    with pytest.raises(GraphValidationError, match="weights missing"):
        partition(g, make_machines(stages=2), max_context=16)


# -- errors a person can act on -------------------------------------------------------------------
def test_context_too_long_says_the_largest_context_that_fits():
    g = llama(LlamaConfig(layers=2))
    machines = make_machines(budgets="1MiB,1MiB")
    with pytest.raises(InfeasiblePlanError) as e:
        partition(g, machines, max_context=1024, sessions=8, tokens=1)
    err = e.value
    assert err.kind == "context"
    best = err.details["largest_context"]
    assert f"largest context that fits is {best} tokens" in str(err) and "1024 tokens" in str(err)
    partition(g, machines, max_context=best, sessions=8, tokens=1)  # fits
    with pytest.raises(InfeasiblePlanError):
        partition(g, machines, max_context=best + 1, sessions=8, tokens=1)
    fewer = err.details["largest_sessions"]
    assert fewer and f"at most {fewer} session" in str(err)
    partition(g, machines, max_context=1024, sessions=fewer, tokens=1)
    with pytest.raises(InfeasiblePlanError):
        partition(g, machines, max_context=1024, sessions=fewer + 1, tokens=1)


def test_weights_larger_than_every_budget_name_the_node():
    g = llama(LlamaConfig(layers=1))
    with pytest.raises(InfeasiblePlanError) as e:
        partition(g, make_machines(budgets="40KiB,40KiB,40KiB,40KiB"), max_context=4, tokens=1)
    assert e.value.kind == "node_too_large"
    msg = str(e.value)
    assert "node 18 (Matmul) using lm_head.weight needs 65.2 KiB" in msg and "largest budget, 40.0 KiB" in msg


def test_more_stages_than_nodes_in_a_graph():
    g = llama(LlamaConfig(layers=1))
    n = len(g.nodes)
    with pytest.raises(InfeasiblePlanError, match=f"only {n} nodes"):
        partition(g, make_machines(stages=n + 1), max_context=4)
    plan = partition(g, make_machines(stages=n + 1), max_context=4, allow_empty=True)
    assert sum(s.empty for s in plan.stages) >= 1


def test_machine_inputs_are_checked():
    with pytest.raises(DistRuntimeError, match="3 speeds"):
        make_machines(budgets="1GiB,2GiB", speeds="1,2,3")
    with pytest.raises(DistRuntimeError, match="not a size"):
        make_machines(budgets="lots")
    with pytest.raises(DistRuntimeError, match="exceeds the budget"):
        make_machines(budgets="1GiB", reserve="2GiB")
    ms = make_machines(budgets="16GiB", stages=3, speeds="1.5", reserve="1GiB")
    assert [m.capacity for m in ms] == [15 * 2**30] * 3 and str(ms[0].speed) == "3/2"


# -- the plan --------------------------------------------------------------------------------------
def test_plan_json_round_trip_and_stable_hash():
    g = llama(LlamaConfig(layers=3))
    machines = make_machines(budgets="2MiB,3MiB,2MiB", speeds="1,2,1", reserve="64KiB")
    plan = partition(g, machines, max_context=128, sessions=2, tokens=8)
    again = partition(g, machines, max_context=128, sessions=2, tokens=8)
    assert plan.hash == again.hash and plan == again
    text = plan.to_json()
    loaded = Plan.from_json(text)
    assert loaded == plan and loaded.hash == plan.hash
    data = json.loads(text)
    assert data["hash"] == plan.hash and data["stages"][0]["memory"]["reserve"] == 64 * 1024
    assert "solver" in data and "solver" not in plan.to_dict(timings=False)
    tampered = json.loads(text)
    tampered["stages"][0]["compute"] += 1
    with pytest.raises(ValueError, match="hash"):
        Plan.from_dict(tampered)
    covered = [nid for s in plan.stages for nid in s.nodes]
    assert covered == list(plan.order) and len(covered) == len(g.nodes)
    assert abs(sum(s.share for s in plan.stages) - 1) < 1e-9


def test_100k_nodes_same_plan_hash_on_every_run():
    rng = np.random.default_rng(3)
    n = 100_000
    names = [f"w{i}" for i in range(n)]
    costs = CostModel.from_parts(rng.integers(1, 1000, size=n).tolist(), weights=[[w] for w in names],
                                 weight_bytes=dict(zip(names, rng.integers(1, 100, size=n).tolist())))
    machines = [Machine(int(costs.weight_bytes.sum() * share), speed, name=f"m{k}") for k, (share, speed)
                in enumerate(zip([.1, .2, .15, .1, .3, .1, .2, .15], [1, 2, 1.5, 1, 3, 1, 2, 1.25]))]
    hashes = {build_plan(costs, machines, solve(costs, machines)).hash for _ in range(2)}
    assert len(hashes) == 1


@pytest.mark.slow  # child processes
def test_plan_hash_does_not_depend_on_the_interpreter_hash_seed():
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, {root!r})
        from dist_runtime.dtypes import DType
        from dist_runtime.examples import LlamaConfig, llama_graph, llama_weights
        from dist_runtime.ir.graph import TensorSpec
        from dist_runtime.partitioner.machines import make_machines
        from dist_runtime.partitioner.planner import partition
        g = llama_graph(LlamaConfig(layers=1500))  # ~21k nodes
        one = llama_weights(LlamaConfig(layers=1))
        g.weights = {{n.replace("layers.0.", f"layers.{{i}}."): TensorSpec(w.shape, DType.F32)
                     for n, w in one.items() for i in range(1500 if "layers.0." in n else 1)}}
        plan = partition(g, make_machines(budgets="40MiB,60MiB,40MiB,60MiB,40MiB,60MiB,40MiB,60MiB",
                         speeds="1,2,1.5,1,3,1,2,1.25"), max_context=64, sessions=4, tokens=1)
        print(plan.hash, len(plan.order), plan.request["granularity_used"])
    """).format(root=str(ROOT))
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode == 0, run.stderr
        outs.add(run.stdout.strip())
    assert len(outs) == 1 and int(outs.pop().split()[1]) > 20_000, outs


# -- the command and the drawing -------------------------------------------------------------------
def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run ``partition`` the way the main CLI does: DistRuntimeError -> message, exit 1."""
    from dist_runtime.partitioner.cli import register

    parser = argparse.ArgumentParser(prog="dist-runtime")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["partition", *argv])
    try:
        code = args.func(args)
    except DistRuntimeError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def llama_path(tmp_path):
    from dist_runtime.model import save_model

    cfg = LlamaConfig(layers=4)
    path = tmp_path / "llama.model"
    save_model(path, llama_graph(cfg), llama_weights(cfg), llama_metadata(cfg)).close()
    return path


def test_cli_table_json_plan_file_and_svg(llama_path, tmp_path, capsys):
    svg, out = tmp_path / "plan.svg", tmp_path / "plan.json"
    code, text, _ = run_cli([str(llama_path), "--budgets", "2MiB,3MiB", "--speeds", "1,2",
                             "--max-context", "256", "--sessions", "2", "--tokens", "8",
                             "--svg", str(svg), "-o", str(out)], capsys)
    assert code == 0
    assert "bottleneck / ideal" in text and "bytes across cuts" in text and "solver" in text
    assert text.count("\n") >= 4 and "m0" in text and "m1" in text
    plan = Plan.from_json(out.read_text())
    root = ET.fromstring(svg.read_text())
    assert root.tag.endswith("svg") and len(root.findall(".//{http://www.w3.org/2000/svg}rect")) > 8
    code, text, _ = run_cli([str(llama_path), "--stages", "3", "--max-context", "64", "--json"], capsys)
    data = json.loads(text)
    assert code == 0 and len(data["stages"]) == 3 and data["hash"] == Plan.from_dict(data).hash
    assert plan.model["nodes"] == data["model"]["nodes"]


def test_cli_errors_exit_1_with_the_reason(llama_path, capsys):
    code, _, err = run_cli([str(llama_path), "--budgets", "64KiB,64KiB", "--max-context", "64"], capsys)
    assert code == 1 and "InfeasiblePlanError" in err
    code, _, err = run_cli([str(llama_path), "--max-context", "64"], capsys)
    assert code == 1 and "--stages" in err


def test_svg_shows_memory_against_budget():
    g = llama(LlamaConfig(layers=2))
    plan = partition(g, make_machines(budgets="1MiB,2MiB", speeds="1,2"), max_context=32, tokens=4)
    svg = plan_svg(plan)
    root = ET.fromstring(svg)
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "stage 0 on m0" in texts and "stage 1 on m1" in texts and "/ 2.0 MiB" in texts
    assert len(root.findall(".//{http://www.w3.org/2000/svg}line")) == 2  # one budget mark per stage


def test_a_decoder_is_planned_for_the_runtime_s_passes_an_encoder_for_whole_sequences():
    """A graph with KV caches runs in passes of at most --max-batch-tokens rows (a prompt in
    chunks): its activations are planned at that, not a whole-context prefill, which no pass
    makes; an encoder takes its whole sequence in one call."""
    from dist_runtime.partitioner.graph_costs import pass_rows
    from dist_runtime.pipeline.launch import make_plan
    from dist_runtime.scheduling_defaults import DEFAULT_BATCH_TOKENS

    g = llama()
    assert pass_rows(g, 4096) == DEFAULT_BATCH_TOKENS and pass_rows(g, 8) == 8 and pass_rows(g, 4096, 512) == 512
    default, chunk, whole = (graph_costs(g, max_context=4096, tokens=t) for t in (None, DEFAULT_BATCH_TOKENS, 4096))
    assert default.meta["tokens"] == DEFAULT_BATCH_TOKENS and np.array_equal(default.live, chunk.live)
    assert whole.live.max() > default.live.max()
    assert np.array_equal(default.kv, whole.kv)  # the caches hold the whole context either way
    encoder = Graph([Node(0, RmsNorm(eps=1e-5), ["x", "w"], ["y"])], [TensorSpec((-1, 32), DType.F32)], ["y"],
                    {"w": TensorSpec((32,), DType.F32)})
    assert pass_rows(encoder, 4096) == 4096
    plan = make_plan(g, stages=2, max_context=256, tokens=64)
    assert plan.request["tokens"] == 64
    assert make_plan(g, stages=2, max_context=32, tokens=64).request["tokens"] == 32  # never past the context


def test_the_plan_counts_the_attention_pieces_the_kernel_cuts():
    """The partitioner's attention workspace and the compiled kernel cut a row's keys alike."""
    pytest.importorskip("numba")
    from dist_runtime.attention_pieces import pieces_of_row
    from dist_runtime.backends.compiled.attention import _pieces

    for keys in (1, 255, 256, 257, 1024, 1025, 4096, 8193):
        assert int(_pieces(1, keys, False, 0)[-1]) == pieces_of_row(keys), keys

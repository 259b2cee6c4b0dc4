"""A multi-node simulation: three raylets on this machine (``ray.cluster_utils.Cluster``), the two
stages pinned to two distinct worker nodes by custom resources.

It proves that each stage actor holds only its own stage's weights: the tensors it holds are
exactly the plan's, their bytes equal the plan's weight bytes for the stage, and the pages of the
model file resident in the actor's process are those bytes (plus the small header sections and
the kernel's fault-around at the edges), well under the whole file.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from conftest import save_example  # noqa: E402
from dist_runtime.examples import LlamaConfig  # noqa: E402
from dist_runtime.executor import GraphExecutor  # noqa: E402
from dist_runtime.model import load_model  # noqa: E402
from dist_runtime.pipeline import Pipeline, Request, StageOptions  # noqa: E402
from dist_runtime.pipeline.reference import reference_tokens  # noqa: E402

# Big enough that a stage's share (~5.7 MB) dwarfs the page-granularity slop.
CFG = LlamaConfig(vocab=1024, hidden=256, layers=4, heads=4, kv_heads=2, ffn=512)


@pytest.fixture(scope="module")
def cluster():
    assert not ray.is_initialized()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for name in ("node_a", "node_b"):
        c.add_node(num_cpus=1, resources={name: 1})
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="dist-runtime-test")
    yield c
    ray.shutdown()
    c.shutdown()


def test_stages_on_distinct_nodes_hold_only_their_weights(cluster, tmp_path):
    path = tmp_path / "llama4.model"
    save_example(path, CFG, seed=1)
    options = StageOptions(fuse=False, cpus=0.5, resources=[{"node_a": 0.01}, {"node_b": 0.01}])
    with Pipeline(path, stages=2, max_context=64, options=options) as p:
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        placed = [r["node_id"] for r in p.reports]
        assert "node_a" in nodes[placed[0]] and "node_b" in nodes[placed[1]]
        assert placed[0] != placed[1]
        reqs = [Request("a", [1, 2, 3], 5), Request("b", [9, 8], 5)]
        got = p.coordinator.generate(reqs)
        reports = ray.get([a.report.remote() for a in p.actors])  # after a run: every weight read
        total = os.path.getsize(path)
        for report, stage in zip(reports, p.plan.stages):
            assert report["source"] == f"file {path.resolve()}"
            assert report["weights"] == list(stage.weights)
            assert report["weight_bytes"] == stage.memory.weights
            resident = report["resident_file_bytes"]
            assert stage.memory.weights <= resident <= stage.memory.weights + 256 * 1024 < total * 0.6
    with load_model(path) as model:
        assert got == reference_tokens(GraphExecutor(model, fuse=False), reqs)

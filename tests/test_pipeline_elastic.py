"""An elastic pipeline on simulated nodes (``ray.cluster_utils.Cluster``): three 1-CPU nodes, one
stage on each, no spare.  A node is removed mid-run: the coordinator re-plans over the two
survivors, replays every session onto the new stages and finishes with the tokens of an
undisturbed run; the re-plan is recorded with its phases."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from conftest import save_example  # noqa: E402
from dist_runtime.engine import LocalEngine, generate  # noqa: E402
from dist_runtime.examples import LlamaConfig  # noqa: E402
from dist_runtime.executor import GraphExecutor  # noqa: E402
from dist_runtime.model import load_model  # noqa: E402
from dist_runtime.pipeline import Pipeline, Request, Sampling, StageOptions  # noqa: E402
from dist_runtime.pipeline.replan import PHASES  # noqa: E402

pytestmark = pytest.mark.slow  # four raylets on this machine

CFG = LlamaConfig(vocab=512, hidden=128, layers=6, heads=4, kv_heads=2, ffn=256)
REQUESTS = [Request("a", [5, 17, 3, 9], 10), Request("b", [42], 10, Sampling(temperature=0.8, top_k=10, seed=11)),
            Request("c", [7, 7, 7, 1], 10, Sampling(temperature=1.1, top_p=0.9, seed=12)), Request("d", [1, 2], 10)]


@pytest.fixture(scope="module")
def cluster():
    assert not ray.is_initialized()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="dist-runtime-test")
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture
def nodes(cluster):
    added = [cluster.add_node(num_cpus=1, resources={"pool": 1}) for _ in range(3)]
    cluster.wait_for_nodes()
    yield added
    for node in added:
        if node in cluster.worker_nodes:
            cluster.remove_node(node)


def _remove(cluster, node_id: str) -> None:
    cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == node_id))


def test_a_lost_node_with_no_spare_shrinks_the_pipeline(cluster, nodes, tmp_path):
    path = save_example(tmp_path / "llama6.model", CFG, seed=3)
    with load_model(path) as model:
        want = generate(LocalEngine(GraphExecutor(model, fuse=False)), REQUESTS).tokens
    options = StageOptions(fuse=False, cpus=1, resources=[{"pool": 0.01}] * 3, spare_timeout=5.0)
    with Pipeline(path, stages=3, max_context=64, sessions=4, options=options) as p:
        co = p.coordinator
        placed = [r["node_id"] for r in p.reports]
        assert len(set(placed)) == 3
        got: dict = {}
        for i, event in enumerate(co.stream(REQUESTS)):
            assert event.error is None, event.error
            got.setdefault(event.session, []).append(event.token)
            if i == 9:
                _remove(cluster, placed[1])
        assert got == want  # every session went on, with the tokens of an undisturbed run
        [replan] = co.replans
        assert replan.trigger == "node lost" and replan.shed == ()
        assert len(replan.old) == 3 and len(replan.new) == 2 and replan.sessions == 4
        assert set(replan.seconds) == set(PHASES) and all(v >= 0 for v in replan.seconds.values())
        assert [r["node_id"] for r in p.reports] == [placed[0], placed[2]]  # the survivors, in order
        assert len(p.plan.stages) == len(co.stages) == len(p.actors) == 2
        summary = co.last_run.summary()
        assert summary["replans"] == [replan.describe()]
        assert "re-plan (node lost" in co.last_run.table()
        assert any(e["name"] == "re-plan: load" for e in co.last_run.trace()["traceEvents"])
        assert "re-plan: 3 -&gt; 2 stages" in co.last_run.svg()
        assert replan.seconds["load"] < 3.0  # the survivors took the new stages: no process started
        # the shrunk pipeline serves new work
        assert co.generate([Request("e", [3], 2)])["e"]

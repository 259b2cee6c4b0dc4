"""An elastic pipeline on simulated nodes (``ray.cluster_utils.Cluster``): three 1-CPU nodes, one
stage on each, no spare.  A node is removed mid-run: the coordinator re-plans over the two
survivors, replays every session onto the new stages and finishes with the tokens of an
undisturbed run; the re-plan is recorded with its phases.  A node that joins grows the pipeline
back; an operator's drain moves the stages off a node; neither loses a token."""

from __future__ import annotations

import logging
import threading

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from conftest import save_example  # noqa: E402
from dist_runtime.engine import LocalEngine, generate  # noqa: E402
from dist_runtime.examples import LlamaConfig  # noqa: E402
from dist_runtime.executor import GraphExecutor  # noqa: E402
from dist_runtime.model import load_model  # noqa: E402
from dist_runtime.pipeline import Pipeline, Request, Sampling, StageOptions  # noqa: E402
from dist_runtime.errors import ClusterError  # noqa: E402
from dist_runtime.pipeline.grow import NodeWatch  # noqa: E402
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


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_example(tmp_path_factory.mktemp("elastic") / "llama6.model", CFG, seed=3)
    with load_model(path) as m:
        want = generate(LocalEngine(GraphExecutor(m, fuse=False)), REQUESTS).tokens
    return path, want


def _pipeline(path, **kw) -> Pipeline:
    options = StageOptions(fuse=False, cpus=1, resources=[{"pool": 0.01}] * 3, spare_timeout=5.0)
    return Pipeline(path, stages=3, max_context=64, sessions=4, options=options, **kw)


def _stream(co, at: int, action) -> dict:
    """The requests' tokens, ``action()`` done after the ``at``-th token."""
    got: dict = {}
    for i, event in enumerate(co.stream(REQUESTS)):
        assert event.error is None, event.error
        got.setdefault(event.session, []).append(event.token)
        if i == at:
            action()
    return got


def test_a_lost_node_with_no_spare_shrinks_the_pipeline_and_a_new_one_grows_it(cluster, nodes, model):
    path, want = model
    with _pipeline(path, grow=False) as p:
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
        assert len(replan.old) == 3 and len(replan.new) == 2 and replan.sessions is None
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

        # A node joins: checked mid-stream (from another thread, as the watch does), the pipeline
        # grows back to three stages at the next safe point, and the stream goes on unchanged.
        watch = NodeWatch(p, poll=3600)
        nodes.append(cluster.add_node(num_cpus=1, resources={"pool": 1}))
        cluster.wait_for_nodes()
        grown: list = []
        checker = threading.Thread(target=lambda: grown.append(watch.check()))
        assert _stream(co, 5, checker.start) == want
        checker.join(60)
        watch.close()
        [grow] = grown
        assert grow is co.replans[-1] and grow.trigger == "node joined" and len(grow.new) == 3
        assert [r["node_id"] for r in p.reports][:2] == [placed[0], placed[2]]
        assert p.reports[2]["node_id"] == nodes[-1].node_id
        assert _stream(co, 0, lambda: None) == want  # and on three stages from the start


def test_a_drained_node_loses_no_request(cluster, nodes, model, caplog):
    path, want = model
    with _pipeline(path, grow=False) as p:
        co, placed = p.coordinator, [r["node_id"] for r in p.reports]
        for bad, why in (("nosuchnode", "no stage runs on that node"), ("", "no stage runs on that node")):
            with pytest.raises(ClusterError, match=why):
                p.drain(bad)
        drained: list = []
        drainer = threading.Thread(target=lambda: drained.append(p.drain(placed[1][:8])))
        assert _stream(co, 9, drainer.start) == want
        drainer.join(60)
        [replan] = drained
        assert replan.trigger == "drain" and len(replan.new) == 2
        assert [r["node_id"] for r in p.reports] == [placed[0], placed[2]]
        assert "replay" in replan.seconds
        p.drain(placed[0])
        with pytest.raises(ClusterError, match="last node"):
            p.drain(placed[2])
        # a drained node is not grown back onto; a node without the label is ignored, saying why
        watch = NodeWatch(p, poll=3600)
        nodes.append(cluster.add_node(num_cpus=1))
        cluster.wait_for_nodes()
        with caplog.at_level(logging.WARNING, logger="dist_runtime.elastic"):
            assert watch.check() is None
        watch.close()
        assert "ignored, it has no 0.01 pool" in caplog.text
        assert len(p.stages) == 1 and _stream(co, 0, lambda: None) == want


def test_an_operator_drains_a_served_pipeline(cluster, nodes, model):
    """``dist-runtime drain`` against a running server, as an operator runs it (another process):
    it lists the stages' nodes, refuses an unknown node in one line, and drains a node while a
    stream runs; /health says recovering with each phase, then ok; the stream's text is that of
    an undisturbed run, /metrics counts the re-plan."""
    import subprocess
    import sys

    httpx = pytest.importorskip("httpx")
    from dist_runtime.serve.metrics import Metrics
    from dist_runtime.serve.served_model import ServedModel
    from dist_runtime.serve.server import PipelineAdmin, Server, pipeline_backend, pipeline_health

    path, _ = model
    served, metrics = ServedModel.open(path, context=64), Metrics()
    p = _pipeline(path, grow=False)
    backend = pipeline_backend(served, p, metrics, max_queue=8)
    ask = {"model": served.id, "prompt": [5, 6, 7, 8], "max_tokens": 24, "temperature": 0}

    def drain(*node: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dist_runtime.cli", "drain", s.url, *node],
                              capture_output=True, text=True, timeout=300)

    with Server(served, backend, metrics, port=0, health=pipeline_health(p), on_close=p.close,
                admin=PipelineAdmin(p)) as s:
        want = httpx.post(s.url + "/v1/completions", json=ask, timeout=120).json()["choices"][0]["text"]
        listed = drain()
        assert listed.returncode == 0 and len(listed.stdout.splitlines()) == 3, listed
        assert all(r["node_id"] in listed.stdout for r in p.reports)
        bad = drain("nosuchnode")
        assert bad.returncode == 1 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1, bad
        assert "no stage runs on that node" in bad.stderr
        victim = p.reports[1]["node_id"]
        healths: list = []
        real_replan = p.replan

        def observed_replan(keep, trigger, cause, progress=lambda phase: None, **kw):
            def observed(phase: str) -> None:  # /health as a client sees it in each phase
                progress(phase)
                healths.append(httpx.get(s.url + "/health", timeout=30).json())

            return real_replan(keep, trigger, cause, observed, **kw)

        p.replan = observed_replan
        text, chunks = "", 0
        with httpx.stream("POST", s.url + "/v1/completions", json={**ask, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += __import__("json").loads(line[6:])["choices"][0]["text"]
                    chunks += 1
                    if chunks == 4:
                        done = drain(victim[:10])
        assert text == want
        assert done.returncode == 0 and "3 stage(s) -> 2" in done.stdout, done
        assert [(h["status"], h["phase"]) for h in healths] == [("recovering", "planning"), ("recovering", "loading")]
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
        assert [r["node_id"] for r in p.reports if r["node_id"] == victim] == []
        scraped = httpx.get(s.url + "/metrics").text
        assert 'dist_runtime_replans_total{trigger="drain"} 1.0' in scraped
        assert 'dist_runtime_replan_seconds_total{phase="load"}' in scraped
        state = httpx.get(s.url + "/admin/pipeline").json()
        assert len(state["stages"]) == 2 and state["drained"] == [victim] and state["replans"][0]["trigger"] == "drain"
        assert httpx.post(s.url + "/admin/drain", json={"node": ""}).status_code == 400

"""Joining a multi-node cluster from the command line, as an operator does: a simulated cluster
(``ray.cluster_utils.Cluster``: a head of 0 CPUs, Ray's advice for a head node, and three nodes
of one CPU) started by one process, ``dist-runtime generate --address`` run in another.  The
stages land one per node by default, the tokens are one process's; with a token file left on the
machine by an embedded Ray (``~/.ray/auth_token``), joining a cluster without tokens still works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import default_signals, save_example
from dist_runtime.examples import LlamaConfig

pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # four raylets and a driver in other processes

CLUSTER = textwrap.dedent("""
    import sys
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": int(sys.argv[1]), "include_dashboard": False})
    for i in range(3):
        c.add_node(num_cpus=1, resources={f"n{i}": 1})
    c.wait_for_nodes()
    print(c.address, flush=True)
    sys.stdin.read()  # until the test closes it
    c.shutdown()
""")


@pytest.fixture(scope="module", params=[0, 1], ids=["head-0-cpus", "head-1-cpu"])
def cluster(request, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("a" * 64)  # as an embedded Ray leaves one
    env = {**os.environ, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER, str(request.param)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, preexec_fn=default_signals)
    try:
        address = proc.stdout.readline().strip()
        assert address, "the cluster did not start"
        yield address, env
    finally:
        proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_the_command_line_places_one_stage_per_node(cluster, tmp_path):
    address, env = cluster
    model = save_example(tmp_path / "m.model", LlamaConfig(vocab=96, hidden=32, layers=3, heads=4, kv_heads=2,
                                                            ffn=64), seed=2)
    run = [sys.executable, "-m", "dist_runtime.cli", "generate", str(model), "--ids", "1,2,3", "-n", "5", "--json"]
    out = subprocess.run(run + ["--address", address, "--stages", "3"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    piped = json.loads(out.stdout)
    nodes = [s["node_id"] for s in piped["pipeline"]["stages"]]
    assert len(set(nodes)) == 3  # one stage per node, the head (if it has a CPU) or not
    assert piped["pipeline"]["micro_batches_reason"] == "each of the 3 stages has a node of its own"
    alone = json.loads(subprocess.run(run, capture_output=True, text=True, env=env, timeout=300).stdout)
    assert [s["ids"] for s in piped["sessions"]] == [s["ids"] for s in alone["sessions"]]
    too_many = subprocess.run(run + ["--address", address, "--stages", "3", "--cpus-per-stage", "2"],
                              capture_output=True, text=True, env=env, timeout=300)
    said = too_many.stdout + too_many.stderr
    assert too_many.returncode == 1 and "Traceback" not in said
    assert "asks for 2 CPU, which no node of the cluster can give" in said

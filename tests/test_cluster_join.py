"""Joining a multi-node cluster from the command line, as an operator does: a simulated cluster
(``ray.cluster_utils.Cluster``: a head of 0 CPUs, Ray's advice for a head node, and three nodes
of one CPU) started by one process, ``dist-runtime generate --address`` run in another.  The
stages land one per node by default, the tokens are one process's; with a token file left on the
machine by an embedded Ray (``~/.ray/auth_token``), joining a cluster without tokens still works.
A node lost mid-run with no spare: the run goes on over the survivors, with the same tokens."""

from __future__ import annotations

import json
import os
import signal
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
    for line in sys.stdin:  # until the test closes it
        if line.strip() == "remove":  # a node lost, as a machine that dies
            c.remove_node(next(iter(c.worker_nodes)))
            print("removed", flush=True)
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
        yield address, env, proc
    finally:
        proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_the_command_line_places_one_stage_per_node(cluster, tmp_path):
    address, env, _ = cluster
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


def test_a_command_line_run_goes_on_when_a_node_is_lost_with_no_spare(cluster, tmp_path):
    """The last test of its cluster (it leaves two nodes).  The run is stopped (SIGSTOP) while a
    node goes, so the loss lands mid-run whatever this machine's speed."""
    address, env, proc = cluster
    if proc.args[-1] != "0":
        pytest.skip("a head with a CPU is a spare: the stage is replaced there, not planned away")
    model = save_example(tmp_path / "m.model", LlamaConfig(vocab=96, hidden=32, layers=3, heads=4, kv_heads=2,
                                                            ffn=64), seed=2)
    run = subprocess.Popen([sys.executable, "-m", "dist_runtime.cli", "generate", str(model), "--ids", "1,2,3",
                            "-n", "40", "--ignore-eos", "--stats", "--check", "--address", address, "--stages", "3"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                           preexec_fn=default_signals)
    try:
        printed = ""
        while printed.count(" ") < 10:  # ten tokens out: the run is under way
            char = run.stdout.read(1)
            assert char, run.stderr.read()[-2000:]
            printed += char
        os.kill(run.pid, signal.SIGSTOP)
        proc.stdin.write("remove\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "removed"
        os.kill(run.pid, signal.SIGCONT)
        out, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            os.kill(run.pid, signal.SIGCONT)
            run.kill()
    said = printed + out
    assert run.returncode == 0, err[-2000:]
    assert "check: the same tokens as one process" in said  # 40 tokens, as one process makes them
    assert "re-plan (node lost: no node took stage(s)" in said and "3 stage(s) on" in said and "-> 2 on" in said
    assert "Traceback" not in err

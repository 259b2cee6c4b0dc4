"""``cluster/jobs/serve.py`` against a real Ray cluster: a private head started with ``ray start
--head --block`` (token authentication on, its own temp dir and ports, in a session of its own),
the job run as a driver with ``RAY_ADDRESS`` set, as the jobs API sets it.

``ray job submit`` itself needs the dashboard, which needs ``ray[default]``; the project depends on
the minimal ``ray``, so the jobs API is not exercised here -- what the job runs is.

The job must serve on the stages it places on that cluster (the greedy tokens of one completion
are ``dist-runtime generate``'s in one process), stop on SIGTERM with serve's status and one line,
kill its stage actors and leave the cluster it joined running.  Every process started here is
stopped in ``finally``, and none may be left in the sessions they ran in.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from conftest import default_signals, job_script, processes_of  # noqa: E402
from dist_runtime.cli import build_parser  # noqa: E402
from dist_runtime.commands import run_command  # noqa: E402

pytestmark = pytest.mark.slow  # a private Ray cluster and job subprocesses

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "cluster" / "jobs" / "serve.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM, then SIGKILL to its whole session if it is still there after ``grace`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 15  # what it started ends shortly after it (Ray's reaper)
    while processes_of(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if processes_of(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class _Lines:
    """A process's output, read on a thread so that its pipe never fills."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=lambda: self.lines.extend(stream), daemon=True)
        self._thread.start()

    def wait_for(self, text: str, proc: subprocess.Popen, seconds: float) -> str | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and proc.poll() is None:
            hit = next((line for line in self.lines if text in line), None)
            if hit:
                return hit
            time.sleep(0.1)
        return next((line for line in self.lines if text in line), None)

    def text(self) -> str:
        self._thread.join(10)
        return "".join(self.lines)


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head of its own: (GCS address, a driver's environment -- the cluster's token, and
    RAY_TMPDIR naming the head's temp dir, where ``--address auto`` finds it -- and the head)."""
    temp = tempfile.mkdtemp(prefix="drt-ray-", dir="/tmp")  # short: Ray's socket paths are limited
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
               PYTHONUNBUFFERED="1", RAY_TMPDIR=temp)
    port = _free_port()
    # Every fixed default port moved to a free one: other Ray instances may run on this machine.
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port", str(port),
           "--node-ip-address", "127.0.0.1", "--dashboard-agent-listen-port", str(_free_port()),
           "--include-dashboard=false", "--num-cpus", "2", "--temp-dir", os.path.join(temp, "ray"),
           "--disable-usage-stats"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_signals)
    err = _Lines(proc.stderr)
    try:
        address_file = Path(temp, "ray", "ray_current_cluster")  # written once the head is up
        deadline = time.monotonic() + 45
        while not address_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert address_file.exists(), f"the Ray head did not start: {err.text()[-2000:]}"
        yield f"127.0.0.1:{port}", env, proc
    finally:
        _stop(proc, 40)  # a head drains on SIGTERM for up to 30 s (usually well under one)
        assert processes_of(proc.pid) == []
        shutil.rmtree(temp, ignore_errors=True)


def _generate_in_one_process(model, ids: list[int], n: int, capsys) -> list[int]:
    args = build_parser().parse_args(["generate", str(model), "--ids", ",".join(map(str, ids)), "-n", str(n),
                                      "--json"])
    capsys.readouterr()
    assert run_command(args.func, args) == 0
    return json.loads(capsys.readouterr().out)["sessions"][0]["ids"]


_CLUSTER_STATE = """
import json, ray
import ray._private.state as state
ray.init(address={address!r}, log_to_driver=False, logging_level="ERROR")
actors = [a for a in state.actors().values() if a["ActorClassName"] == "StageWorker"]
print(json.dumps({{"nodes": sum(n["Alive"] for n in ray.nodes()), "stages": sorted(a["State"] for a in actors),
                   "task": ray.get(ray.remote(lambda: 7).remote())}}))
"""


@pytest.mark.parametrize("join", ["RAY_ADDRESS", "auto"])
def test_serve_job_on_a_cluster_it_joins_and_leaves_running(ray_head, pipeline_model, capsys, join):
    """``RAY_ADDRESS``: as under ``ray job submit``; ``auto``: as under ``ray submit`` or the head's
    start commands (the cluster ``ray start`` recorded on the node), waiting for its one node."""
    t0 = time.monotonic()
    address, env, head = ray_head
    want = _generate_in_one_process(pipeline_model, [5, 6, 7, 8], 12, capsys)
    args, job_env = ["--wait-for-nodes", "1"], env
    if join == "RAY_ADDRESS":
        args, job_env = [], {**env, "RAY_ADDRESS": address}
    job = subprocess.Popen([sys.executable, str(JOB), str(pipeline_model), "--stages", "2", "--port", "0",
                            "--cpus-per-stage", "0.5", "--max-context", "64", *args],
                           env=job_env, cwd=tempfile.gettempdir(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=default_signals)
    out, err = _Lines(job.stdout), _Lines(job.stderr)
    try:
        line = out.wait_for("serving ", job, 60)
        assert line, f"the job did not start serving: {out.text()[-1000:]} {err.text()[-3000:]}"
        assert "on 2 pipeline stages at http://127.0.0.1:" in line, line
        url = line.split(" at ")[1].split("/v1")[0]
        assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok", "model": "tiny4"}
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": "tiny4", "prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        assert [int(t) for t in r.json()["choices"][0]["text"].split()] == want

        job.send_signal(signal.SIGTERM)
        assert job.wait(30) == 128 + 15
    finally:
        _stop(job, 10)
    assert processes_of(job.pid) == []
    stderr = err.text()
    assert "dist-runtime serve: terminated" in stderr and "Traceback" not in stderr, stderr[-3000:]

    # The cluster it joined is still there, its stage actors are gone, and it takes new work.
    assert head.poll() is None
    check = subprocess.run([sys.executable, "-c", _CLUSTER_STATE.format(address=address)], env=env,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr[-3000:]
    state = json.loads(check.stdout.splitlines()[-1])
    assert state["nodes"] == 1 and state["task"] == 7, state
    assert len(state["stages"]) in (2, 4) and set(state["stages"]) == {"DEAD"}, state  # this run's and the last's
    took = time.monotonic() - t0  # bounds a hang the steps' own timeouts would not catch, not a speed
    assert took < 90, f"the job's run on the cluster took {took:.0f} s"


def _job(*args: str, env_address: str | None = "127.0.0.1:1") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    if env_address:
        env["RAY_ADDRESS"] = env_address  # nothing listens there: these must fail before joining
    return subprocess.run([sys.executable, str(JOB), *args], env=env, capture_output=True, text=True, timeout=60)


def test_serve_job_without_the_model_on_the_node_says_so_in_one_line(tmp_path):
    missing = tmp_path / "absent.model"
    done = _job(str(missing), "--stages", "2")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: ClusterError: the model file {missing} is not on "
                                                   f"this node ({socket.gethostname()})"), done.stderr


def test_serve_job_without_the_servers_packages_says_so_in_one_line(pipeline_model):
    blocked = ("import runpy, sys; sys.modules['uvicorn'] = sys.modules['jinja2'] = None; "
               f"sys.argv = [{str(JOB)!r}, {str(pipeline_model)!r}, '--stages', '2']; "
               f"runpy.run_path({str(JOB)!r}, run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_ADDRESS": "127.0.0.1:1"}
    done = subprocess.run([sys.executable, "-c", blocked], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"error: DistRuntimeError: uvicorn, jinja2 not installed for {sys.executable} on this node: run the job with "
        f"the python of the cluster's venv, where the project is installed with its [serve] extra (cluster/*.yaml's "
        f"head_setup_commands)"], done.stderr


def test_serve_job_wants_stages(pipeline_model):
    done = _job(str(pipeline_model))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: DistRuntimeError: a cluster job serves the model split into pipeline stages: give --stages N, "
        "--budgets SIZES or --plan PLAN.json (without them `dist-runtime serve` runs the model in this driver "
        "alone)"]


def load_job_script():
    """cluster/jobs/serve.py as a module (it is a script, not part of the package)."""
    return job_script("serve.py")


def test_serve_job_joins_the_cluster_of_its_node_unless_told_otherwise(monkeypatch):
    job_script = load_job_script()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    job, args, command = job_script.parse(["m.model", "--stages", "2", "--wait-for-nodes", "3"])
    assert (job.wait_for_nodes, job.wait_timeout) == (3, 600.0)
    assert command == ["serve", "m.model", "--stages", "2", "--address", "auto"]  # never an embedded Ray
    assert job_script.parse(["m.model", "--stages", "2", "--address=10.0.0.10:6379"])[2][-1] == "--address=10.0.0.10:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.10:6379")  # the jobs API's
    assert job_script.parse(["m.model", "--stages", "2"])[2] == ["serve", "m.model", "--stages", "2"]
    with pytest.raises(SystemExit) as usage:  # serve's own usage errors, status 2
        job_script.parse(["m.model", "--stages", "two"])
    assert usage.value.code == 2


def test_serve_job_waiting_for_nodes_that_never_join_gives_up_in_one_line(ray_head, pipeline_model):
    address, env, _ = ray_head
    done = subprocess.run([sys.executable, str(JOB), str(pipeline_model), "--stages", "2", "--wait-for-nodes", "2",
                           "--wait-timeout", "1"], env={**env, "RAY_ADDRESS": address}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["waiting for 2 nodes: 1 alive"]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: ClusterError: 1 of the 2 nodes asked for (--wait-for-nodes) joined the cluster within 1 s: see the "
        "launcher's log (`ray monitor CONFIG`) for the rest"), done.stderr[-3000:]


def test_the_configs_serve_deployment_starts_and_the_next_ray_up_stops_it(ray_head, pipeline_model, tmp_path):
    """cluster/local.yaml's own head commands, run by bash as ``ray up`` runs them, on the private
    head.  HOME is a scratch directory holding what the config's file_mounts and setup commands
    put in ~ (the project, the venv, the token file); only the placeholder model path, the port
    (8000 may be taken on this machine) and the node count (this cluster has one) are replaced."""
    yaml = pytest.importorskip("yaml")
    _, env, _ = ray_head
    starts = yaml.safe_load((REPO / "cluster" / "local.yaml").read_text())["head_start_ray_commands"]
    stop_old = starts[0]
    [serve] = [c for c in starts if "~/dist-runtime/cluster/jobs/serve.py" in c]
    assert "dist-runtime-serve.pid" in stop_old and starts.index(serve) == len(starts) - 1
    for placeholder, value in (("/models/EDIT-ME.model", str(pipeline_model)), ("--port 8000", "--port 0"),
                               ("--wait-for-nodes 3", "--wait-for-nodes 1")):
        assert placeholder in serve
        serve = serve.replace(placeholder, value)
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / "dist-runtime").symlink_to(REPO)
    (home / "dist-runtime-venv").symlink_to(sys.prefix)
    (home / ".ray" / "auth_token").write_text(env["RAY_AUTH_TOKEN"])  # the command names the file
    run_env = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"} | {"HOME": str(home)}
    pid_file, log = home / "dist-runtime-serve.pid", home / "dist-runtime-serve.log"

    def sh(command: str) -> int:
        return subprocess.run(["bash", "-c", command], env=run_env, timeout=60).returncode

    shell = subprocess.Popen(["bash", "-c", serve], env=run_env, start_new_session=True, preexec_fn=default_signals)
    other = None
    try:
        assert shell.wait(15) == 0  # at once: the server runs on in the background
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 60  # (the shell may not have opened the log yet)
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and \
                "serving " not in (log.read_text() if log.exists() else ""):
            time.sleep(0.2)
        assert "cluster/jobs/serve.py" in Path(f"/proc/{pid}/cmdline").read_text()  # the pid is the server's
        line = next((x for x in log.read_text().splitlines() if x.startswith("serving ")), None)
        assert line, log.read_text()[-3000:]
        url = line.split(" at ")[1].split("/v1")[0]
        assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"

        assert sh(stop_old) == 0  # the next `ray up`: the server ends (SIGTERM) before `ray stop`
        assert not Path(f"/proc/{pid}").exists() and not pid_file.exists()
        assert log.read_text().rstrip().endswith("dist-runtime serve: terminated"), log.read_text()[-3000:]
        assert sh(stop_old) == 0  # no pid file (the first `ray up`): nothing to do

        other = subprocess.Popen(["sleep", "60"])  # a pid file naming something else (a reused pid)
        pid_file.write_text(f"{other.pid}\n")
        assert sh(stop_old) == 0
        assert other.poll() is None and not pid_file.exists()
    finally:
        if other is not None:
            other.kill()
            other.wait()
        if processes_of(shell.pid):  # the background server, had a check above failed
            os.killpg(shell.pid, signal.SIGTERM)
            deadline = time.monotonic() + 20
            while processes_of(shell.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if processes_of(shell.pid):
                os.killpg(shell.pid, signal.SIGKILL)
    assert processes_of(shell.pid) == []

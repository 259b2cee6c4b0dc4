"""Every ``cluster/*.yaml`` is a config ``ray up`` accepts, and its serve deployment would run.

``ray up`` (``ray.autoscaler._private.commands._bootstrap_config``) first fills the config in with
``prepare_config`` (the provider's defaults, merged setup commands, node types), then asks the
provider to fill in node resources, validates it with ``validate_config`` (jsonschema against
``ray-schema.json``, plus its own checks), and last lets the provider bootstrap it (for AWS: key
pairs, security groups, IAM, through boto3 with credentials).  Here the first and the third run,
Ray's own functions, with no cloud and no network: boto3 and botocore cannot be imported, and no
socket may connect.  The provider's two steps need an account (the AWS config names its nodes'
resources, so the autofill has nothing to add).

Beyond the schema: every project file a command names exists, and the serve deployment's command
line parses with the job's and ``dist-runtime serve``'s own parsers, asks for as many nodes as the
config brings up, and its head installs the server's dependencies.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

from conftest import job_script  # noqa: E402
from dist_runtime.pipeline.options import wants_pipeline  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "cluster").glob("*.yaml"))
#: Where the configs' file_mounts put the project on every node.
PROJECT = "~/dist-runtime"
COMMAND_LISTS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                 "head_start_ray_commands", "worker_start_ray_commands")


@pytest.fixture
def offline(monkeypatch):
    """No cloud SDK and no network: what runs here must need neither."""
    for name in ("boto3", "botocore"):
        monkeypatch.setitem(sys.modules, name, None)  # `import boto3` raises ImportError

    def refuse(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_offline_means_no_cloud_and_no_network(offline):
    with pytest.raises(ImportError):  # what the AWS provider's bootstrap is made of
        importlib.import_module("ray.autoscaler._private.aws.config")
    with pytest.raises(AssertionError, match="network"):
        socket.create_connection(("127.0.0.1", 9))


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _checked(config: dict) -> dict:
    """What ``ray up`` makes of ``config`` before the provider sees it, validated as it does."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_the_configs_are_found():
    assert {p.name for p in CONFIGS} >= {"local.yaml", "aws.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_against_rays_schema(path, offline):
    prepared = _checked(_load(path))
    assert prepared["head_node_type"] in prepared["available_node_types"]
    assert any("serve.py" in c for c in prepared["head_start_ray_commands"])  # the serve deployment


BROKEN = {
    # a field the schema does not have (as an invented home for the serve deployment would be)
    "unknown top-level key": (lambda c: c.update(serve_commands=["python cluster/jobs/serve.py m.model"]),
                              "serve_commands"),
    # a folded scalar without its "- ": one string, not a list of commands
    "commands as a string": (lambda c: c.update(head_start_ray_commands="ray start --head"),
                             "head_start_ray_commands"),
    "number as text": (lambda c: c.update(idle_timeout_minutes="five"), "five"),
}


@pytest.mark.parametrize("what", sorted(BROKEN))
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_broken_copy_is_rejected(path, what, offline):
    config = _load(path)
    breaks, named = BROKEN[what]
    breaks(config)
    with pytest.raises(jsonschema.ValidationError, match=re.escape(named)):
        _checked(config)


def _commands(config: dict) -> list[str]:
    return [c for key in COMMAND_LISTS for c in config.get(key) or []]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_commands_name_only_files_of_the_project(path):
    config = _load(path)
    assert config["file_mounts"][PROJECT] == ".", "the project is mounted where the commands look for it"
    named = {m for c in _commands(config) for m in re.findall(re.escape(PROJECT) + r"/([\w./-]+)", c)}
    assert "cluster/jobs/serve.py" in named
    missing = sorted(n for n in named if not (REPO / n).exists())
    assert not missing, f"{path.name} names {missing}, not in the project"


def _job_script():
    return job_script("serve.py")


def serve_argv(command: str) -> list[str]:
    """The arguments the head's start command gives cluster/jobs/serve.py."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True  # words as the shell splits them, operators apart
    words = list(lexer)
    start = next(i for i, w in enumerate(words) if w.endswith("cluster/jobs/serve.py")) + 1
    end = next((i for i in range(start, len(words)) if set(words[i]) <= set(";&|<>")), len(words))
    return words[start:end]


def _nodes(config: dict) -> int:
    """Nodes ``ray up`` brings up: the head and the workers it starts with."""
    if config["provider"]["type"] == "local":
        return 1 + len(config["provider"]["worker_ips"])
    return 1 + sum(t.get("min_workers", 0) for t in config["available_node_types"].values())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_serve_deployment_parses_and_fits_the_cluster(path, monkeypatch):
    config = _load(path)
    [command] = [c for c in config["head_start_ray_commands"] if f"{PROJECT}/cluster/jobs/serve.py" in c]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # as on the head: the job joins --address auto
    job, args, serve_command = _job_script().parse(serve_argv(command))
    assert serve_command[:2] == ["serve", "/models/EDIT-ME.model"]  # the placeholder a user edits
    assert args.address == "auto" and wants_pipeline(args)
    assert args.host == "127.0.0.1"  # reached through SSH (ray attach -p), never open to the network
    assert job.wait_for_nodes == _nodes(config), "waits for the nodes the config brings up"
    starts = config["head_start_ray_commands"]
    assert starts.index(command) > next(i for i, c in enumerate(starts) if "ray start --head" in c)
    assert "nohup " in command and "< /dev/null &" in command and "> ~/dist-runtime-serve.log 2>&1" in command
    if args.stage_resources:  # every resource a stage is pinned to is some node type's
        given = {r for t in config["available_node_types"].values() for r in t.get("resources", {})}
        assert set(args.stage_resources.split(",")) <= given
    head_setup = (config.get("setup_commands") or []) + (config.get("head_setup_commands") or [])
    assert any(f'{PROJECT}"[serve]"' in c for c in head_setup), "the head needs FastAPI and uvicorn"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_python_on_the_nodes_is_the_venvs(path, tmp_path):
    """``ray submit`` runs ``python SCRIPT`` in a shell that sources ~/.bashrc: the setup command
    that activates the venv there, run twice (``ray up`` again), in bash with a scratch HOME."""
    [command] = [c for c in _load(path)["setup_commands"] if ".bashrc" in c]
    (tmp_path / "dist-runtime-venv").symlink_to(sys.prefix)  # what the setup commands make
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for _ in range(2):
        subprocess.run(["bash", "-c", command], env=env, check=True, timeout=30)
    assert (tmp_path / ".bashrc").read_text().count("activate") == 1
    found = subprocess.run(["bash", "-c", "source ~/.bashrc && command -v python"], env=env, capture_output=True,
                           text=True, timeout=30).stdout.strip()
    assert found == str(Path(sys.prefix) / "bin" / "python")  # the venv's, not the system's

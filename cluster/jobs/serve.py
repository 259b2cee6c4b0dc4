"""Cluster job: serve a model split into pipeline stages over the OpenAI-compatible API
(``dist-runtime serve``).

Three ways to run it::

    # the cluster launcher copies this file to the head node and runs it there
    ray submit cluster/local.yaml cluster/jobs/serve.py -- /models/llama.model --stages 2

    # the jobs API uploads the working directory (the project) and runs it on the cluster; --no-wait
    # since a server does not finish; the venv's python by its full path (whatever PATH the job
    # inherits; `ray job submit` quotes each word, so a `~` would not expand)
    ray job submit --no-wait --working-dir . -- /home/ubuntu/dist-runtime-venv/bin/python \
        cluster/jobs/serve.py /models/llama.model --stages 2

    # from the head's start commands (cluster/local.yaml, cluster/aws.yaml): up with the cluster
    python ~/dist-runtime/cluster/jobs/serve.py /models/llama.model --stages 2 --wait-for-nodes 3

Every option of ``dist-runtime serve`` applies (``--help``); one of ``--stages``, ``--budgets`` or
``--plan`` is required, since a job that served in its driver alone would leave the cluster idle.
The server listens on ``--host`` (default 127.0.0.1: the node the job runs on, the head; reach it
through an SSH tunnel, ``ray attach CONFIG -p 8000``) and prints ``serving ... at URL`` when ready.

The job joins the cluster it runs on -- ``RAY_ADDRESS`` (set by the jobs API), else ``--address
auto`` (the cluster ``ray start`` recorded on this node) -- and never starts a Ray of its own.
SIGTERM (``ray job stop``) or Ctrl-C ends the streams, kills the stage actors and disconnects;
the cluster keeps running.  Two options of the job itself:

``--wait-for-nodes N``
    wait until the cluster has N nodes alive before placing the stages (the head's start
    commands run before any worker has joined);
``--wait-timeout SECONDS``
    how long to wait for them (default 600).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import time
from pathlib import Path


def _import_project() -> None:
    """Under ``ray job submit --working-dir .`` the project is the working directory, but Python
    puts this script's own directory first on sys.path, not the working directory.  (Each job
    script has its own copy: ``ray submit`` uploads the script alone.)"""
    try:
        import dist_runtime  # noqa: F401 -- installed on the node
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        if (root / "dist_runtime").is_dir():
            sys.path.insert(0, str(root))
        else:
            sys.exit("error: dist_runtime is not installed on this node: run the cluster's setup "
                     "commands (cluster/local.yaml), or submit with --working-dir pointing at the project")


def _job_options() -> argparse.ArgumentParser:
    from dist_runtime.commands import positive_float, positive_int

    # allow_abbrev off: a prefix such as --wait must never swallow an option meant for serve.
    job = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    job.add_argument("--wait-for-nodes", type=positive_int, default=None, metavar="N")
    job.add_argument("--wait-timeout", type=positive_float, default=600.0, metavar="SECONDS")
    return job


def parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace, list[str]]:
    """(the job's options, ``dist-runtime serve``'s parsed arguments, the command line for serve).
    Usage errors exit with status 2 and serve's usage, as ``dist-runtime serve`` would."""
    from dist_runtime.cli import build_parser

    job, rest = _job_options().parse_known_args(argv)
    parser = build_parser()
    args = parser.parse_args(["serve", *rest])
    command = ["serve", *rest]
    if args.address is None and not os.environ.get("RAY_ADDRESS"):
        command += ["--address", "auto"]  # a job runs on a cluster, never on an embedded Ray
        args.address = "auto"
    return job, args, command


def check(job: argparse.Namespace, args: argparse.Namespace) -> None:
    """What the job needs of the node it runs on, as the project's errors (one line each)."""
    from dist_runtime.errors import ClusterError, DistRuntimeError
    from dist_runtime.pipeline.options import wants_pipeline

    missing = [name for name in ("ray", "fastapi", "uvicorn", "jinja2") if not _importable(name)]
    if missing:  # else a traceback from deep in serve; the job's `python` is whichever PATH names
        raise DistRuntimeError(f"{', '.join(missing)} not installed for {sys.executable} on this node: run the job "
                               f"with the python of the cluster's venv, where the project is installed with its "
                               f"[serve] extra (cluster/*.yaml's head_setup_commands)")
    if not wants_pipeline(args):
        raise DistRuntimeError("a cluster job serves the model split into pipeline stages: give --stages N, "
                               "--budgets SIZES or --plan PLAN.json (without them `dist-runtime serve` runs "
                               "the model in this driver alone)")
    if not Path(args.model).is_file():
        where = Path(args.model) if Path(args.model).is_absolute() else Path.cwd() / args.model
        raise ClusterError(f"the model file {where} is not on this node ({socket.gethostname()}): the job's "
                           f"driver reads the graph (and the tokenizer beside it) there; copy it to that path on "
                           f"the node the job runs on (the head), or give the path where it is")
    if job.wait_for_nodes:
        _wait_for_nodes(args, job.wait_for_nodes, job.wait_timeout)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # a module set to None in sys.modules: blocked
        return False


def _wait_for_nodes(args: argparse.Namespace, want: int, timeout: float) -> None:
    from dist_runtime.errors import ClusterError
    from dist_runtime.pipeline.cluster import connect

    # The same join `dist-runtime serve` makes (its Pipeline then finds Ray connected).
    connect(args.address, timeout=args.connect_timeout)
    import ray

    deadline = time.monotonic() + timeout
    said = None
    while True:
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        if alive >= want:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"{alive} of the {want} nodes asked for (--wait-for-nodes) joined the cluster "
                               f"within {timeout:g} s: see the launcher's log (`ray monitor CONFIG`) for the rest")
        if alive != said:
            print(f"waiting for {want} nodes: {alive} alive", flush=True)
            said = alive
        time.sleep(2.0)


def main(argv: list[str]) -> int:
    _import_project()
    from dist_runtime.cli import main as cli_main
    from dist_runtime.commands import handle_sigterm, run_command

    job, args, command = parse(argv)
    handle_sigterm()  # a SIGTERM while waiting for nodes ends the job with one line, as serve's does
    status = run_command(lambda a: check(job, a) or 0, args)
    return status or cli_main(command)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

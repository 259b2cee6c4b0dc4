"""Connecting to Ray: an embedded local instance on demand, or an existing cluster.

Without an address (and without ``RAY_ADDRESS``) the runtime starts a private Ray on this machine,
with no dashboard and in its own namespace, and stops it when done.  Ray's GCS, raylet and workers
still listen on the node's address (Ray's gRPC servers do not bind to loopback only): what protects
them is Ray's token authentication, on by default.  With ``--address auto`` (a cluster started on this machine with ``ray start``)
or ``--address HOST:PORT`` / ``RAY_ADDRESS``, it joins that cluster and leaves it running.

Authentication is Ray's own: with ``RAY_AUTH_MODE=token`` set on the cluster, a driver needs the
same token (``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``, default ``~/.ray/auth_token``); Ray
reads them from the environment, so nothing here handles the token itself.  docs/cluster.md
covers tokens and TLS.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket

from ..errors import ClusterError

NAMESPACE = "dist-runtime"

#: Seconds to reach a cluster given by --address / RAY_ADDRESS before giving up (``--connect-timeout``).
CONNECT_TIMEOUT = 30.0

_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
_TOKEN_HINT = ("if the cluster uses token authentication (RAY_AUTH_MODE=token), this driver needs the same token: "
               "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN, or the token file at RAY_AUTH_TOKEN_PATH "
               "(default ~/.ray/auth_token)")


def cluster_address(address: str | None) -> str | None:
    """The cluster to join (``--address``, else ``RAY_ADDRESS``), checked, or None for an embedded
    Ray.  Refuses at once what Ray would hang on or fail on with a traceback."""
    given, where = (address, "--address") if address else (os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS")
    if not given:
        return None
    if given == "auto":
        return given
    if re.match(r"^https?://", given):
        raise ClusterError(f"{where}={given} is the address of Ray's jobs API and dashboard (what `ray job submit` "
                           f"takes), not a cluster to join: give the head node's HOST:PORT (port 6379 by "
                           f"default), or 'auto' on a node of the cluster"
                           + (", or unset RAY_ADDRESS for an embedded local Ray" if where == "RAY_ADDRESS" else ""))
    if not _HOST_PORT.match(given) or not 0 < int(_HOST_PORT.match(given).group(2)) < 65536:
        raise ClusterError(f"{where}={given!r} is not a cluster address: give HOST:PORT (the head node's GCS "
                           f"port, 6379 by default) or 'auto' (the cluster started on this machine)")
    return given


def _reachable(address: str, timeout: float) -> None:
    host, port = _HOST_PORT.match(address).groups()
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except socket.gaierror as e:
        raise ClusterError(f"cannot reach the Ray cluster at {address}: unknown host {host!r} ({e.strerror})") from None
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise ClusterError(f"cannot reach the Ray cluster at {address}: {why}. Is `ray start --head` running "
                           f"there, and is the port open to this machine?") from None


def connect(address: str | None = None, *, num_cpus: int | None = None, namespace: str = NAMESPACE,
            quiet: bool = True, timeout: float = CONNECT_TIMEOUT) -> bool:
    """Make sure this process is connected to Ray; returns True if this call started or joined it
    (so the caller should shut it down), False if Ray was already initialised.

    Joins a cluster only when asked (``address`` or ``RAY_ADDRESS``), within ``timeout`` seconds,
    with a ``ClusterError`` naming the address (and the token, when that may be why) otherwise.
    """
    target = cluster_address(address)  # before importing Ray: a bad address is refused at once
    if target is not None:
        _token_if_present()
    import ray

    if ray.is_initialized():
        return False
    with _keeping_sigterm():
        return _init(ray, target, num_cpus, namespace, quiet, timeout)


@contextlib.contextmanager
def _keeping_sigterm():
    """``ray.init`` installs its own SIGTERM handlers (exit at once, or drain the node): keep the
    process's own, so a command is torn down as it chose (``commands.Terminated``)."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if previous not in (None, signal.SIG_DFL):  # a handler the process chose, not the default
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _worker_niceness():
    """Ray starts its workers -- the stage actors -- at nice 15, below the driver and Ray's own
    servers, so that on a shared machine any of those preempts the stages' compute: at nice 15, 2
    stages decode 8 sessions at 0.84-0.98x one process (bench_batching, 5 runs), at nice 0 at
    0.91-0.98x (3 stages: 0.79-0.89x against 0.89-0.94x).  The embedded Ray's workers run at the driver's priority
    (``RAY_worker_niceness``, read by the raylet this starts; a value already set wins); a cluster's
    ``ray start`` sets it in cluster/*.yaml."""
    had = os.environ.get("RAY_worker_niceness")
    os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        yield
    finally:
        if had is None:
            os.environ.pop("RAY_worker_niceness", None)


def _init(ray, target: str | None, num_cpus, namespace: str, quiet: bool, timeout: float) -> bool:
    if target is None:
        # Embedded: always a fresh private instance ("local"), never one that Ray's session file
        # names (a stale or foreign cluster there would be joined, or waited for forever).  No
        # dashboard; Ray's own servers still listen on the node's address, and what guards them
        # is Ray's token authentication, which Ray turns on for a new local instance and then
        # announces on every run: the note is dropped (docs/security.md says it once).
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        with _worker_niceness():
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace=namespace,
                     log_to_driver=not quiet, configure_logging=not quiet)
        return True
    if target == "auto":
        target = _started_here()
    _reachable(target, min(timeout, 10.0))
    # Ray retries an unanswered GCS for a minute by default: bound it by the deadline.
    os.environ.setdefault("RAY_gcs_rpc_server_connect_timeout_s", str(max(1, int(timeout))))
    try:
        ray.init(address=target, namespace=namespace, log_to_driver=not quiet)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ClusterError(f"cannot join the Ray cluster at {target}: {why}; {_TOKEN_HINT}") from None
    return True


def _token_if_present() -> None:
    """Joining a cluster with a token given in ``RAY_AUTH_TOKEN``: present it (token mode).  A
    token *file* alone does not turn token mode on: the embedded local Ray writes one in
    ``~/.ray/auth_token`` on every machine it runs on, and a driver in token mode cannot take
    part in a cluster without tokens (the GCS's calls back to it are refused and it cancels the
    driver's actors).  A token-authenticated cluster asks for ``RAY_AUTH_MODE=token``, as Ray's
    own CLI does, and then the file is read.  Ray reads the mode once, when it is imported, so
    this must run first; an explicit RAY_AUTH_MODE wins."""
    import sys

    if "RAY_AUTH_MODE" in os.environ or "ray" in sys.modules:
        return
    if os.environ.get("RAY_AUTH_TOKEN"):
        os.environ["RAY_AUTH_MODE"] = "token"


def _started_here() -> str:
    """What ``--address auto`` means here: the cluster that ``ray start`` last started on this
    machine (the address it wrote in Ray's temporary folder) -- never any Ray process found
    running, which may be another program's private instance (Ray's own fallback for "auto")."""
    from ray._common.utils import get_ray_address_file

    path = get_ray_address_file(None)
    try:
        with open(path) as f:
            address = f.read().strip()
    except OSError:
        address = ""
    if not _HOST_PORT.match(address):
        raise ClusterError("no Ray cluster was started on this machine (--address auto joins the one `ray start "
                           "--head` started; none is recorded in " + path + "): start one, give HOST:PORT, or drop "
                           "--address for an embedded local Ray")
    return address


def describe() -> dict:
    """Nodes and resources of the connected cluster (for ``--stats`` and the job script)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return {
        "nodes": [{"node_id": n["NodeID"], "address": n["NodeManagerAddress"],
                   "resources": {k: v for k, v in n["Resources"].items() if not k.startswith("node:")}}
                  for n in nodes],
        "resources": ray.cluster_resources(),
    }


def call_all(actors, method: str, *args, timeout: float | None):
    """``actor.method(*args)`` on every actor at once; their results in order (``ray.get``)."""
    import ray

    return ray.get([getattr(a, method).remote(*args) for a in actors], timeout=timeout)


def call_each(actors, method: str, values, timeout: float | None = 60.0):
    """``actor.method(value)`` for each actor and its value, at once; their results in order."""
    import ray

    return ray.get([getattr(a, method).remote(v) for a, v in zip(actors, values)], timeout=timeout)

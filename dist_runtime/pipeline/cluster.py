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

import os

NAMESPACE = "dist-runtime"


def connect(address: str | None = None, *, num_cpus: int | None = None, namespace: str = NAMESPACE,
            quiet: bool = True) -> bool:
    """Make sure this process is connected to Ray; returns True if this call started or joined it
    (so the caller should shut it down), False if Ray was already initialised."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, namespace=namespace, log_to_driver=not quiet)
    else:
        # Embedded: always a fresh private instance ("local"), never one that Ray's session file
        # names (a stale or foreign cluster there would be joined, or waited for forever).  No
        # dashboard; Ray's own servers still listen on the node's address, and what guards them
        # is Ray's token authentication, on by default (docs/security.md).
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace=namespace,
                 log_to_driver=not quiet, configure_logging=not quiet)
    return True


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

"""Placing stage actors on the cluster and giving each its weights.

One actor per stage.  Each reserves ``cpus`` (by default the cluster's free CPUs shared evenly)
and caps its BLAS pool at that many threads: several stages on one machine would otherwise each start
a pool of every core and fight over them.  Stages are spread over nodes (``SPREAD``) unless
``resources`` pins each to nodes that advertise a custom resource (``ray start
--resources='{"stage0": 1}'``).

Weights: each actor first tries to map its tensors from the model file at ``worker_path`` (the
same path as the driver's by default: a shared file system or a copy on every node).  If the file
is not there, or is not the same file (``weights.fingerprint``), the driver puts that stage's
tensors -- and only those -- in the object store for it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..compile_notice import waiting
from ..errors import ClusterError, DistRuntimeError, StageUnavailableError
from .cluster import call_all, call_each
from .stage import stage_actor_class, thread_env
from .options import WEIGHT_SOURCES, StageOptions
from .subgraph import StageGraph
from .weights import fingerprint

def resolve_cpus(options: StageOptions, n_stages: int) -> StageOptions:
    """``options`` with ``cpus`` and ``threads`` fixed: a replacement stage started later must
    reserve what the first ones did, not a share of what happens to be free then."""
    import dataclasses

    import ray

    # By default each stage asks for what lets it have a node of its own when there are enough
    # nodes (the smallest of the n largest: a cluster's total shared out would ask some for more
    # than their node has), else a share of the CPUs still free (another pipeline may hold some);
    # each process's thread pool is as large as the largest node: placement then tells each stage
    # how many of them to compute on (launch.placement_threads), which it can only know once placed.
    sizes = sorted((c for c in node_cpus().values() if c > 0), reverse=True)
    share = max(ray.available_resources().get("CPU", 0.0), 0.01 * n_stages) / n_stages
    cpus = options.cpus or (sizes[n_stages - 1] if len(sizes) >= n_stages > 1 else share)
    return dataclasses.replace(options, cpus=cpus, threads=options.threads or max(1, int(max(sizes, default=cpus))))


def node_cpus() -> dict[str, float]:
    """Each live node's CPUs, by node id."""
    import ray

    return {n["NodeID"]: n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")}


def check_placeable(options: StageOptions, n_stages: int) -> None:
    """Refuse at once what Ray would wait for forever: a stage asking for more CPUs than any
    node has, or for a resource no node has.  Compares with the nodes' totals (not what is free:
    another run may free its share)."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    for k in range(n_stages):
        asked = {"CPU": options.cpus or 0, **(options.resources[k] if options.resources else {})}
        if any(all(res.get(name, 0) >= amount for name, amount in asked.items()) for res in nodes):
            continue
        for name, amount in asked.items():
            have = max((res.get(name, 0) for res in nodes), default=0)
            if have < amount:
                known = sorted({r for res in nodes for r in res if not r.startswith("node:")} | {"node:<ip>"})
                what = (f"{amount:g} {name}" if name == "CPU" else f"resource {name!r}")
                exists = (f"the largest node has {have:g}" if have else
                          f"no node has it (resources: {', '.join(known)})")
                raise ClusterError(f"stage {k} asks for {what}, which no node of the cluster can give: {exists}"
                                   + ("; lower --cpus-per-stage" if name == "CPU" else
                                      "; check --stage-resources against the nodes' resources"))
        raise ClusterError(f"stage {k} asks for {asked}, which no single node of the cluster has")


def deploy(model_path: str | os.PathLike, stages: list[StageGraph], options: StageOptions) -> tuple[list, list[dict]]:
    """Start one actor for each of ``stages`` (all of a plan's, or the ones to replace) and load
    their weights; returns (actors, load reports).  ``options`` comes from :func:`resolve_cpus`.

    On failure every actor started here is killed before the error propagates.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ..model import load_model

    if options.weights not in WEIGHT_SOURCES:
        raise DistRuntimeError(f"weights must be one of {', '.join(WEIGHT_SOURCES)}, got {options.weights!r}")
    if options.resources is not None and len(options.resources) <= max(st.index for st in stages):
        raise DistRuntimeError(f"{len(options.resources)} resource sets given for "
                               f"{max(st.index for st in stages) + 1} stages")
    Actor = stage_actor_class()
    actors = []
    try:
        for stage in stages:
            opts: dict = {"num_cpus": options.cpus, "max_restarts": 0,
                          "runtime_env": {"env_vars": {**thread_env(options.threads, options.cpus), **options.extra_env}}}
            if options.resources is not None:
                opts["resources"] = options.resources[stage.index]
            if options.nodes is not None:
                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(options.nodes[stage.index], soft=False)
            elif options.resources is None and options.spread:
                opts["scheduling_strategy"] = "SPREAD"
            kwargs = dict(fuse=options.fuse, backends=options.backends, seed=options.seed, threads=options.threads,
                          kv_dtype=options.kv_dtype)
            if options.max_sessions:
                kwargs["max_sessions"] = options.max_sessions
            actors.append(Actor.options(**opts).remote(stage, **kwargs))
        _placed(actors, options)
        try:
            with waiting(f"the {len(stages)} stage actors", "loading their weights and warming up; a node's "
                         "first run compiles the kernels, ~1 min"):
                reports = _load_weights(Path(model_path), stages, actors, options, load_model)
        except ray.exceptions.GetTimeoutError:
            # Placed, but loading includes the warm-up, which on a node whose numba cache is cold
            # compiles the kernels: ~90 s on an idle core here, more on a busy one.
            raise StageUnavailableError(
                f"the stage actors were placed but did not all load their weights and warm up (which "
                f"compiles the kernels on a node's first run) within {options.load_timeout:.0f} s") from None
    except BaseException:
        kill(actors)
        raise
    return actors, reports


def redeploy(model_path: str | os.PathLike, stages: list[StageGraph], actors: list,
             options: StageOptions) -> list[dict]:
    """Give running actors (one per stage of a new plan, in order) their new stages and load
    those stages' weights; returns the load reports.  Faster than new actors: the processes and
    their compiled kernels are there already."""
    from ..model import load_model

    call_each(actors, "restage", stages, timeout=options.load_timeout)
    with waiting(f"the {len(stages)} re-planned stages", "loading their weights"):
        return _load_weights(Path(model_path), stages, actors, options, load_model)


def _placed(actors: list, options: StageOptions) -> None:
    """Wait until every actor is running on a node (``placement_timeout``): a stage no node can
    take fails here, in seconds, whatever its loading would take."""
    import ray

    try:
        call_all(actors, "ping", timeout=options.placement_timeout)
    except ray.exceptions.GetTimeoutError:
        raise StageUnavailableError(
            f"the stage actors were not all placed within {options.placement_timeout:.0f} s: "
            f"each asks for {options.cpus:g} CPU(s){' and ' + str(options.resources) if options.resources else ''}; "
            f"the cluster has {ray.available_resources().get('CPU', 0):g} CPU(s) free") from None


def _load_weights(path: Path, stages, actors, options: StageOptions, load_model) -> list[dict]:
    import ray

    worker_path = str(options.worker_path or path.resolve())
    with load_model(path, tensors=[], validate=False) as model:
        if options.weights == "store":
            loaded = [{"loaded": False, "reason": "weights='store'"} for _ in stages]
        else:
            expected = [fingerprint(model, st.weights) for st in stages]
            loaded = ray.get([a.load_file.remote(worker_path, fp) for a, fp in zip(actors, expected)],
                             timeout=options.load_timeout)
        pending = []
        for stage, actor, result in zip(stages, actors, loaded):
            if result["loaded"]:
                continue
            if options.weights == "file":
                raise DistRuntimeError(f"stage {stage.index}: {result['reason']} (weights='file')")
            # Only this stage's tensors: the object store copy is the stage's share, not the model.
            ref = ray.put({name: model.tensor(name) for name in stage.weights})
            pending.append(actor.load_weights.remote(ref))
            result["fallback"] = result["reason"]
            del ref  # the actor's views keep the object alive for as long as it needs them
        ray.get(pending, timeout=options.load_timeout)
    return call_all(actors, "report", timeout=options.load_timeout)


def kill(actors: list) -> None:
    """Kill actors (ours, by handle); the KV caches and mapped weights go with them."""
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 -- already dead, or Ray already shut down
            pass

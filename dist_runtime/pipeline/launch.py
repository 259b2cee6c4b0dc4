"""``Pipeline``: plan, cut, deploy and coordinate, as one object with a ``close()``.

    with Pipeline("model.model", stages=2) as p:
        tokens = p.coordinator.generate([Request("a", [1, 2, 3], max_new_tokens=8)])
        print(p.coordinator.last_run.table())
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Callable, Sequence

from ..dtypes import kv_dtype
from ..errors import ClusterError, DistRuntimeError, StageUnavailableError
from ..scheduling_defaults import DEFAULT_BATCH_TOKENS
from .channels import DEFAULT_CHANNEL, make_channel
from .cluster import CONNECT_TIMEOUT, call_each, connect
from .coordinator import Coordinator, Repaired
from .grow import NodeWatch
from .deploy import check_placeable, deploy, kill, node_cpus, redeploy, resolve_cpus
from .options import StageOptions, stage_options
from .replan import Replan, Stopwatch, held_sessions, joined_machine, largest_plan, stage_summary, surviving_machines
from .subgraph import StageGraph, stages_for_plan


def make_plan(graph, *, stages: int | None = None, budgets=None, speeds=None, reserve="0",
              max_context: int = 4096, sessions: int = 1, model_name: str = "", tokens: int | None = None,
              kv_dtype: str | None = None):
    """A partitioner plan from the CLI's vocabulary (``--stages N`` or ``--budgets``); ``tokens``:
    the rows of the largest pass (``--max-batch-tokens``; default: the partitioner's)."""
    from dist_runtime.partitioner.machines import make_machines
    from dist_runtime.partitioner.graph_costs import pass_rows
    from dist_runtime.partitioner.planner import partition

    if stages is None and not budgets:
        raise DistRuntimeError("give a number of stages, or a memory budget per machine")
    machines = make_machines(stages, budgets, speeds, reserve)
    if tokens is not None:
        tokens = pass_rows(graph, max_context, tokens)
    return partition(graph, machines, max_context=max_context, sessions=sessions, model_name=model_name,
                     tokens=tokens, kv_dtype=kv_dtype)


DEFAULT_CONTEXT = 4096


def context_limit(metadata: dict, default: int = DEFAULT_CONTEXT) -> int:
    """The longest sequence the model takes (its position table, as the importers record it),
    capped at ``default``: what unknown sequence dims are planned for."""
    config = metadata.get("config") if isinstance(metadata.get("config"), dict) else {}
    known = [v for v in (config.get("context_length"), config.get("positions")) if isinstance(v, int) and v > 0]
    return min([default, *known])


def kv_rows(plan) -> int | None:
    """The KV rows a plan sized the stages' memory for: its sessions times its context."""
    sessions, context = plan.request.get("sessions"), plan.request.get("max_context")
    return sessions * context if isinstance(sessions, int) and isinstance(context, int) else None


def placement_micro_batches(reports: list[dict], asked: int | None) -> tuple[int, str]:
    """How many passes travel at once, and why: one per stage when every stage has a machine of
    its own (stage k computes pass i while k+1 computes i-1); one when stages share a machine,
    whose cores and memory bandwidth a split batch would only make them re-read the weights with."""
    if asked is not None:
        return asked, "asked for (--micro-batches)"
    nodes = [r.get("node_id") or r.get("host") for r in reports]
    if len(set(nodes)) == len(nodes) > 1:
        return len(nodes), f"each of the {len(nodes)} stages has a node of its own"
    return 1, ("one stage" if len(nodes) == 1 else
               f"{len(nodes)} stages share {len(set(nodes))} node(s): they take turns on its cores")


def placement_threads(reports: list[dict], cpus: dict[str, float], micro_batches: int,
                      asked: int | None) -> tuple[list[int], str]:
    """Each stage's compute threads, and why, so that no core idles while work waits: a stage
    alone on its node, or taking turns with the others there (one pass in flight), uses all the
    node's cores; stages computing at once on a node (several passes in flight) split them."""
    if asked is not None:
        return [asked] * len(reports), "asked for (--threads-per-stage)"
    nodes = [r.get("node_id") or r.get("host") for r in reports]
    threads = []
    for node in nodes:
        cores, sharing = max(1, int(cpus.get(node, 1))), nodes.count(node)
        at_once = 1 if micro_batches == 1 else min(sharing, micro_batches)
        threads.append(max(1, cores // at_once))
    shared = len(set(nodes)) < len(nodes)
    if not shared:
        why = "each stage alone on its node: all its cores"
    elif micro_batches == 1:
        why = "stages sharing a node take turns: each uses all its cores"
    else:
        why = f"up to {micro_batches} passes in flight: stages computing at once on a node split its cores"
    return threads, why


class Pipeline:
    """A model running as one Ray actor per stage of a plan."""

    def __init__(self, model_path: str | os.PathLike, *, plan=None, stages: int | None = None,
                 budgets=None, speeds=None, reserve="0", max_context: int | None = None, sessions: int = 1,
                 channel: str = DEFAULT_CHANNEL, options: StageOptions | None = None, address: str | None = None,
                 num_cpus: int | None = None, timeout: float | None = 600.0,
                 connect_timeout: float = CONNECT_TIMEOUT, micro_batches: int | None = None,
                 max_batch_tokens: int = DEFAULT_BATCH_TOKENS, grow: bool = True) -> None:
        from ..model import load_model

        self.path = Path(model_path)
        self._started_ray = False
        self.options = options or StageOptions()
        asked_threads = self.options.threads
        self.actors: list = []
        self.channel = None
        self.drained: set[str] = set()  # node ids an operator drained: never planned onto again
        self.watch: NodeWatch | None = None  # grows the pipeline onto nodes that join (grow.py)
        self.channel_kind = channel
        # Everything that needs no Ray is checked before Ray starts (seconds): the model, the plan.
        with load_model(self.path, tensors=[]) as model:
            if model.graph is None:
                raise DistRuntimeError(f"{self.path} has no graph section: there is nothing to run")
            self.graph = model.graph
            name = str(model.metadata.get("name") or self.path.name)
            max_context = max_context or context_limit(model.metadata)
            kv = kv_dtype(self.options.kv_dtype, model.metadata.get("kv_dtype")).name.lower()
            self.options = dataclasses.replace(self.options, kv_dtype=kv)
        self.plan = plan or make_plan(self.graph, stages=stages, budgets=budgets, speeds=speeds,
                                      reserve=reserve, max_context=max_context, sessions=sessions,
                                      model_name=name, tokens=max_batch_tokens, kv_dtype=self.options.kv_dtype)
        self.stages: list[StageGraph] = stages_for_plan(self.graph, self.plan)
        self._started_ray = connect(address, num_cpus=num_cpus, timeout=connect_timeout)
        try:
            self.options = resolve_cpus(self.options, len(self.stages))
            check_placeable(self.options, len(self.stages))
            self._asked = (micro_batches, asked_threads)
            self._place()
            self.coordinator = Coordinator(self.stages, self.actors, self.channel, timeout=timeout,
                                           repair=self.repair, micro_batches=self.micro_batches,
                                           max_batch_tokens=max_batch_tokens, max_kv_rows=kv_rows(self.plan))
            self.coordinator.batching = next((r["batching"] for r in self.reports if r.get("batching")), None)
            self.coordinator.warm_up()
            self.watch = NodeWatch(self) if grow else None
        except BaseException:
            self.close()
            raise

    def _place(self) -> None:
        """Deploy every stage, link them, and choose the micro-batches and threads."""
        self.actors, self.reports = deploy(self.path, self.stages, self.options)
        self.channel = make_channel(self.channel_kind, self.actors)
        self._choose_threads()

    def _choose_threads(self) -> None:
        """The micro-batches in flight and each stage's compute threads, from where they run."""
        micro_batches, threads = self._asked
        self.micro_batches, self.micro_batches_reason = placement_micro_batches(self.reports, micro_batches)
        chosen, self.threads_reason = placement_threads(self.reports, node_cpus(), self.micro_batches, threads)
        self.threads = call_each(self.actors, "set_threads", chosen)

    def repair(self, dead: list[int], progress: Callable[[str], None] = lambda phase: None) -> Repaired:
        """Replace the actors of the ``dead`` stages (killed first, in case they only hang) and
        rebuild the channel over all stages; when no node takes a dead stage within
        ``spare_timeout``, re-plan over the surviving stages' nodes instead.  ``progress`` hears
        the phases ("planning", "loading").  The coordinator calls it."""
        kill([self.actors[k] for k in dead])  # first: closing the links of a frozen actor would wait
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if dead:
            try:
                self._replace(dead)
            except StageUnavailableError as e:
                keep = [k for k in range(len(self.stages)) if k not in dead]
                if not keep:
                    raise StageUnavailableError(f"every stage was lost and no node can take one: {e}") from None
                return self.replan(keep, "node lost", f"no node took stage(s) {', '.join(map(str, dead))}",
                                   progress)
        self.channel = make_channel(self.channel_kind, self.actors)
        return Repaired(self.actors, self.channel)

    def _replace(self, dead: list[int]) -> None:
        """New actors for the ``dead`` stages, where the cluster has room; ``StageUnavailableError``
        at once when it has none, else after ``spare_timeout`` seconds unplaced."""
        import ray

        free = ray.available_resources()
        for k in dead:
            asked = {"CPU": self.options.cpus or 0, **(self.options.resources[k] if self.options.resources else {})}
            short = [name for name, amount in asked.items() if free.get(name, 0.0) < amount]
            if short:
                raise StageUnavailableError(f"no node has the {' and '.join(short)} stage {k} asks for")
        options = dataclasses.replace(self.options, placement_timeout=self.options.spare_timeout)
        fresh, reports = deploy(self.path, [self.stages[k] for k in dead], options)
        for k, actor, report in zip(dead, fresh, reports):
            self.actors[k], self.reports[k] = actor, report
        call_each(fresh, "set_threads", [self.threads[k] for k in dead])

    def replan(self, keep: list[int], trigger: str, cause: str,
               progress: Callable[[str], None] = lambda phase: None, *, joined: Sequence[str] = (),
               shed: bool = True, fresh: tuple | None = None) -> Repaired:
        """Plan the model again (:mod:`.replan`) over the nodes of the stages in ``keep``, then the
        ``joined`` nodes, with the machines' first budgets, for as many of the first plan's
        sessions as fit (``shed=False``: all of them, else ``ClusterError`` before anything
        changes); then give every stage of the new plan an actor pinned to its node: the kept
        stages' actors take the first ones, new actors the joined nodes' (``fresh``: those of
        :meth:`prepare`, deployed while the pipeline still served).  The sessions' KV caches are
        gone: the coordinator replays them."""
        at, watch = time.time(), Stopwatch()
        progress("planning")
        old = stage_summary(self.plan, self.reports)
        plan, stages, options = fresh[:3] if fresh else self.prepare(keep, joined, shed, trigger)
        watch.mark("plan")
        progress("loading")
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.options, self.plan, self.stages = options, plan, stages
        # The surviving actors take the first stages: no process to start, no kernel to load.
        gone = [a for k, a in enumerate(self.actors) if k not in keep]
        self.actors = [self.actors[k] for k in keep]
        kill(gone)
        try:
            self.reports = redeploy(self.path, stages[:len(keep)], self.actors, options)
            added = fresh[3:] if fresh else deploy(self.path, stages[len(keep):], options) if joined else ([], [])
            self.actors, self.reports = self.actors + added[0], self.reports + added[1]
        except Exception as e:  # noqa: BLE001 -- not retried: the old stages are gone
            raise ClusterError(f"the pipeline was re-planned over {len(stages)} node(s), but its new stages "
                               f"could not be loaded there: {type(e).__name__}: {e}") from None
        self.channel = make_channel(self.channel_kind, self.actors)
        self._choose_threads()
        watch.mark("load")
        record = Replan(trigger, cause, old, stage_summary(plan, self.reports), held_sessions(plan), at,
                        watch.seconds)
        return Repaired(self.actors, self.channel, stages=self.stages, max_kv_rows=kv_rows(plan),
                        micro_batches=self.micro_batches, replan=record)

    def prepare(self, keep: list[int], joined: Sequence[str] = (), shed: bool = True, trigger: str = "re-plan"):
        """(plan, stages, options) of a re-plan over the stages in ``keep`` and the ``joined``
        nodes; see :meth:`replan`."""
        nodes = [self.reports[k].get("node_id") for k in keep] + list(joined)
        plan = self._plan_over(keep, joined)
        if not shed and plan.request["sessions"] < self.plan.request["sessions"]:
            raise ClusterError(f"{trigger}: the {len(nodes)} remaining node(s) hold the KV caches of "
                               f"{plan.request['sessions']} session(s), the pipeline was planned for "
                               f"{self.plan.request['sessions']}; nothing was changed")
        label = self.options.resources[0] if self.options.resources else None  # a joined node's: the shared one
        resources = [self.options.resources[k] for k in keep] + [label] * len(joined) if label else None
        options = dataclasses.replace(self.options, resources=resources, nodes=nodes if all(nodes) else None)
        return plan, stages_for_plan(self.graph, plan), options

    def grow(self, node: str) -> Replan:
        """Add ``node`` (a Ray node id) as the pipeline's last stage: the plan over it, and its
        actor with its weights, are made while the pipeline serves; at the next safe point the
        other stages take their new parts and every session is replayed."""
        keep = list(range(len(self.stages)))
        plan, stages, options = self.prepare(keep, [node], shed=False, trigger="grow")
        actors, reports = deploy(self.path, stages[len(keep):], options)
        try:
            return self.coordinator.replan(lambda progress: self.replan(
                keep, "node joined", f"node {node[:12]} joined", progress, joined=[node],
                fresh=(plan, stages, options, actors, reports)))
        except BaseException:
            kill(actors)
            raise

    def _plan_over(self, keep: list[int], joined: Sequence[str] = ()):
        """The partitioner's plan over the machines of the stages in ``keep`` and the ``joined``
        nodes (their Ray memory as the budget when the first plan had budgets), for as many of
        the first plan's sessions as fit."""
        from dist_runtime.partitioner.planner import partition

        machines, request = surviving_machines(self.plan, keep), self.plan.request
        machines += [joined_machine(self.plan, node) for node in joined]
        return largest_plan(lambda sessions: partition(
            self.graph, machines, max_context=request["max_context"], sessions=sessions, tokens=request["tokens"],
            kv_dtype=request["kv_dtype"], granularity=request.get("granularity", "auto"),
            model_name=self.plan.model.get("name")), request["sessions"])

    def drain(self, node: str) -> Replan:
        """Move the stages off ``node`` (a Ray node id, or its first characters) at a safe point:
        the pipeline is re-planned over its other nodes and every session replayed; no request
        is lost.  Refused (``ClusterError``) for a node no stage runs on, the pipeline's last
        node, or when the others cannot hold the sessions' KV caches."""
        ids = [r.get("node_id") or "" for r in self.reports]
        on = [k for k, n in enumerate(ids) if node and n.startswith(node)]
        if not on or len({ids[k] for k in on}) > 1:
            raise ClusterError(f"drain {node!r}: {'no stage runs on that node' if not on else 'more than one node matches'}"
                               f" (the stages' nodes: {', '.join(n[:12] for n in ids)})")
        keep = [k for k in range(len(ids)) if k not in on]
        if not keep:
            raise ClusterError(f"drain {node!r}: it is the pipeline's last node; stop the pipeline instead")
        self.drained.add(ids[on[0]])
        return self.coordinator.replan(lambda progress: self.replan(keep, "drain", f"node {ids[on[0]][:12]} drained",
                                                                    progress, shed=False))

    def memory(self, timeout: float = 60.0) -> list[dict]:
        """Each stage's memory now (:meth:`.stage.StageWorker.memory`: resident and peak bytes,
        weights, KV in use and reserved) beside what the plan estimated for it."""
        import ray

        now = ray.get([actor.memory.remote() for actor in self.actors], timeout=timeout)
        return [{**m, "plan": {"weights": st.memory.weights, "kv": st.memory.kv, "activations": st.memory.activations,
                               "total": st.memory.total}}
                for m, st in zip(now, self.plan.stages)]

    def close(self) -> None:
        """Tear down the channel, kill the stage actors, and stop Ray if this pipeline started it."""
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        kill(self.actors)
        self.actors = []
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_pipeline(args, sessions: int) -> Pipeline:
    """``Pipeline`` for the parsed deployment options (:func:`.options.add_deployment_options`),
    planned for ``sessions`` sessions at once: what ``generate --stages`` and ``serve --stages`` run."""
    plan = None
    if args.plan:
        from dist_runtime.partitioner.plan import Plan

        plan = Plan.from_json(Path(args.plan).read_text(), where=f"--plan {args.plan}")
    return Pipeline(args.model, plan=plan, stages=args.stages, budgets=args.budgets, speeds=args.speeds,
                    reserve=args.reserve, max_context=args.max_context, sessions=sessions,
                    channel=args.channel, options=stage_options(args), address=args.address,
                    num_cpus=args.num_cpus, timeout=args.timeout, connect_timeout=args.connect_timeout,
                    micro_batches=args.micro_batches, max_batch_tokens=args.max_batch_tokens)

"""``Pipeline``: plan, cut, deploy and coordinate, as one object with a ``close()``.

    with Pipeline("model.model", stages=2) as p:
        tokens = p.coordinator.generate([Request("a", [1, 2, 3], max_new_tokens=8)])
        print(p.coordinator.last_run.table())
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..dtypes import kv_dtype
from ..errors import DistRuntimeError
from ..scheduling_defaults import DEFAULT_BATCH_TOKENS
from .channels import DEFAULT_CHANNEL, make_channel
from .cluster import CONNECT_TIMEOUT, call_each, connect
from .coordinator import Coordinator
from .deploy import check_placeable, deploy, kill, node_cpus, resolve_cpus
from .options import StageOptions, stage_options
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
                 max_batch_tokens: int = DEFAULT_BATCH_TOKENS) -> None:
        from ..model import load_model

        self.path = Path(model_path)
        self._started_ray = False
        self.options = options or StageOptions()
        asked_threads = self.options.threads
        self.actors: list = []
        self.channel = None
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
            self.actors, self.reports = deploy(self.path, self.stages, self.options)
            self.channel = make_channel(channel, self.actors)
            self.micro_batches, self.micro_batches_reason = placement_micro_batches(self.reports, micro_batches)
            threads, self.threads_reason = placement_threads(self.reports, node_cpus(), self.micro_batches,
                                                             asked_threads)
            self.threads = call_each(self.actors, "set_threads", threads)
            self.coordinator = Coordinator(self.stages, self.actors, self.channel, timeout=timeout,
                                           repair=self.repair, micro_batches=self.micro_batches,
                                           max_batch_tokens=max_batch_tokens, max_kv_rows=kv_rows(self.plan))
            self.coordinator.batching = next((r["batching"] for r in self.reports if r.get("batching")), None)
            self.coordinator.warm_up()
        except BaseException:
            self.close()
            raise

    def repair(self, dead: list[int]) -> tuple[list, object]:
        """Replace the actors of the ``dead`` stages (killed first, in case they only hang) and
        rebuild the channel over all stages; returns (actors, channel).  The coordinator calls it."""
        kill([self.actors[k] for k in dead])  # first: closing the links of a frozen actor would wait
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if dead:
            fresh, reports = deploy(self.path, [self.stages[k] for k in dead], self.options)
            for k, actor, report in zip(dead, fresh, reports):
                self.actors[k], self.reports[k] = actor, report
            call_each(fresh, "set_threads", [self.threads[k] for k in dead])
        self.channel = make_channel(self.channel_kind, self.actors)
        return self.actors, self.channel

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

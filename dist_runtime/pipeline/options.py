"""How stages are deployed, as the command line and callers state it (no Ray or numpy imported:
``dist-runtime --help`` builds its parsers from these)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import ClusterError

WEIGHT_SOURCES = ("auto", "file", "store")

#: Sessions one stage keeps at most: each holds KV caches, so an unbounded number is a memory leak
#: (or an attack); the coordinator closes sessions it is done with.
MAX_SESSIONS = 4096


@dataclass
class StageOptions:
    cpus: float | None = None  # per stage; None: the cluster's free CPUs shared evenly
    threads: int | None = None  # BLAS threads per stage; None: the reservation, at least 1
    resources: list[dict] | None = None  # per stage, e.g. [{"stage0": 1}, {"stage1": 1}]
    weights: str = "auto"  # "auto": the file if it is there, else the object store
    worker_path: str | None = None  # where workers find the model (default: the driver's path)
    fuse: bool = True
    kv_dtype: str | None = None  # what the stages' KV caches keep K and V in (None: the model's, else f16)
    backends: list[str] | None = None
    seed: int = 0
    spread: bool = True
    max_sessions: int | None = None
    extra_env: dict = field(default_factory=dict)
    placement_timeout: float = 120.0  # seconds for the actors to be placed (running on a node)
    # seconds for a failed stage's replacement to be placed before the pipeline is re-planned
    # over the surviving nodes instead (a spare node, if there is one, takes it in about one)
    spare_timeout: float = 10.0
    nodes: list[str] | None = None  # per stage, the Ray node id it must run on (a re-plan pins them)
    # seconds for placed actors to load their weights and warm up: a node's first run compiles the
    # kernels (~100 s on an idle core of the 2-core test machine, minutes on a busy one)
    load_timeout: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("placement_timeout", "spare_timeout", "load_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ClusterError(f"StageOptions.{name} must be a positive number of seconds, got {value!r}")


def add_deployment_options(p) -> None:
    """The options of a run split into stages (``generate --stages`` and ``pipeline`` share them)."""
    from ..commands import positive_float, positive_int
    from .channels import CHANNELS, DEFAULT_CHANNEL
    from .cluster import CONNECT_TIMEOUT

    plan = p.add_argument_group("split into pipeline stages on Ray (embedded local Ray unless --address)")
    plan.add_argument("--stages", type=positive_int, metavar="N", help="number of stages (machines without a memory limit)")
    plan.add_argument("--budgets", metavar="SIZES", help="memory budget per stage, in pipeline order, e.g. 8GiB,16GiB")
    plan.add_argument("--speeds", metavar="LIST", help="relative speed per stage, e.g. 1,2 (default: all 1)")
    plan.add_argument("--reserve", default="0", metavar="SIZE", help="memory kept free per machine (default: 0)")
    plan.add_argument("--max-context", type=positive_int, default=None, metavar="TOKENS",
                      help="longest context a session may reach; sizes the KV caches in the plan and "
                           "bounds prompt + new tokens (default: the model's context length, at most 4096)")
    plan.add_argument("--plan", metavar="PLAN.json", help="use a plan from `dist-runtime partition -o` instead")
    plan.add_argument("--max-in-flight", type=positive_int, metavar="N",
                      help="sessions with a step in the pipeline at once (default: all of them)")
    plan.add_argument("--address", metavar="ADDR",
                      help="an existing Ray cluster ('auto', or host:port; default: RAY_ADDRESS, else an embedded local Ray)")
    plan.add_argument("--num-cpus", type=positive_int, metavar="N", help="CPUs of the embedded local Ray (default: all)")
    plan.add_argument("--channel", choices=CHANNELS, default=DEFAULT_CHANNEL,
                      help="how steps travel between stages (default: %(default)s; see docs/cluster.md)")
    plan.add_argument("--weights", choices=WEIGHT_SOURCES, default="auto",
                      help="auto: map the file where it exists on a node, else send the stage's tensors "
                           "through the object store (default: auto)")
    plan.add_argument("--worker-path", metavar="PATH", help="where the workers find the model (default: MODEL, absolute)")
    plan.add_argument("--cpus-per-stage", type=positive_float, metavar="N", help="CPU reservation per stage (default: shared evenly)")
    plan.add_argument("--threads-per-stage", type=positive_int, metavar="N",
                      help="compute threads per stage (default: placement's choice, in --stats: all of "
                           "its node's cores when it is alone there or takes turns with the stages there, "
                           "a share when several passes in flight make stages on a node compute at once)")
    plan.add_argument("--stage-resources", metavar="NAMES",
                      help="pin stage k to the node with resource NAME_k, e.g. node:10.0.0.11,node:10.0.0.12 "
                           "(Ray's per-node resource) or custom ones like stage0,stage1")
    plan.add_argument("--connect-timeout", type=positive_float, default=CONNECT_TIMEOUT, metavar="SECONDS",
                      help="longest wait to reach and join the cluster of --address / RAY_ADDRESS "
                           "(default: %(default)g)")
    plan.add_argument("--timeout", type=positive_float, default=600.0, metavar="SECONDS",
                      help="longest wait for one step's reply before the run fails (default: 600; a dead "
                           "stage is noticed at once)")
    plan.add_argument("--timeline", metavar="FILE.svg", help="draw the per-stage timeline (who was busy when)")
    plan.add_argument("--trace", metavar="FILE.json",
                      help="write the run as Chrome trace-event JSON (as `ray timeline` does; open in Perfetto)")
    plan.add_argument("--micro-batches", type=positive_int, metavar="N",
                      help="passes in flight at once (default: one per stage when every stage has a node of "
                           "its own, else 1: stages sharing a machine take turns on its cores)")
    plan.add_argument("--check", action="store_true",
                      help="also run the requests in one process (GraphExecutor) and compare the tokens")


def wants_pipeline(args) -> bool:
    return bool(args.stages or args.budgets or args.plan)


def stage_options(args) -> StageOptions:
    resources = None
    if args.stage_resources:
        names = [n.strip() for n in args.stage_resources.split(",") if n.strip()]
        resources = [{n: 0.001} for n in names]  # a sliver: several stages may share a node
    return StageOptions(cpus=args.cpus_per_stage, threads=args.threads_per_stage, resources=resources,
                        weights=args.weights, worker_path=args.worker_path, fuse=not args.no_fuse,
                        kv_dtype=args.kv_dtype, backends=_numerics_backends(getattr(args, "numerics", None)))


def _numerics_backends(numerics: str | None) -> list[str] | None:
    """The stages' backends for ``--numerics`` (None: the default, auto)."""
    from ..backends import NUMERICS

    return None if numerics in (None, "auto") else [NUMERICS[numerics]]

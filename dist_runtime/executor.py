"""GraphExecutor: runs a graph in one process, statefully, one session or many.

The walk is the seed's: nodes in topological order, each on the backend chosen for it, every
intermediate freed right after its last consumer.  Everything that can be decided once is decided
in ``__init__`` -- backend per node, which weights stay in their stored (possibly quantized) form,
the free-after list of every step -- so that ``run`` is a short loop, as in JAX's ``eval_jaxpr``.

State lives in sessions.  Each session has its own KV caches (one ``KvState`` per KvCache node),
position and random generator, so that a pipeline stage can interleave conversations; the seed's
single-conversation executor is the one-session case (session ``0``, the default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Hashable, Mapping, Sequence

import numpy as np

from dist_runtime.kernels.attention import KvState, KvStates
from dist_runtime.kernels.quant import to_float
from dist_runtime.kernels.registry import KernelContext

from .arena import pack, process_memory
from .backends import Backend, ChainedNodeError, chain_reads, make_backends, program
from .backends.assign import Assignment, assign_backends
from .backends.blas import WEIGHT_SLOTS
from .batched_pass import ROWS, SEGMENTED, NodeRows, PerSegment, RowPlan, Segment, offsets, plan_rows
from . import dtypes
from .errors import DistRuntimeError, GraphValidationError, KernelError
from .ir.graph import POS, Graph, TensorSpec
from .ir.ops import KvCache, Sdpa, SdpaWindow
from .ir.validate import check_memory, estimate_memory, infer_shapes, validate_graph
from .tensor import Array, QuantizedArray, dtype_of

#: The session ``run`` and ``reset`` use when none is named.
DEFAULT_SESSION: Hashable = 0

#: The context of a step computed once over every session's rows (it reads no session state).
_PLAIN = KernelContext()
#: The ``kv_cache`` of the step that runs the compiled program: its context holds the session's
#: KV states by key (:meth:`GraphExecutor._context`).
_PROGRAM = KvCache(0)
#: Ops whose kernels may mix a pass's rows in one call (BLAS blocks a product by rows): on a
#: backend that is not batch-invariant they make the executor so.
_ROW_MIXING = (*WEIGHT_SLOTS, Sdpa, SdpaWindow)


@dataclass
class Session:
    """One conversation: KV caches by node position, the position of its next row, its sampler."""

    seed: int
    pos: int = 0
    kv: KvStates = field(default_factory=KvStates)
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def reset(self) -> None:
        for state in self.kv.values():
            state.reset()
        self.pos = 0
        self.rng = np.random.default_rng(self.seed)


@dataclass(frozen=True)
class _Step:
    """One node, bound: what to read, what to call, what to write, what to free after."""

    index: int
    fn: object  # BoundKernel
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    frees: tuple[str, ...]
    kv_cache: KvCache | None  # the payload, for a stateful KvCache step (or a chain holding one)
    rows: NodeRows  # how it runs in a batched pass
    state: int = -1  # the node whose KvState a stateful step keys (-1: its own, ``index``)

    @property
    def state_key(self) -> int:
        """The key of its KvState among a session's."""
        return self.index if self.state < 0 else self.state


#: Suffix of the name under which a shared launch's first step passes a sibling its result.
_SHARED = "@shared"


def _shared_launches(steps: list[_Step], graph: Graph, backends: list[Backend], constants,
                     rows: RowPlan) -> list[_Step]:
    """Adjacent steps that read one tensor and a weight each, on one backend that launches them
    together (its optional ``bind_siblings(nodes)``: the q, k and v products of a layer), as one
    launch: the first step computes every result, and each other step passes its own on (under
    ``<output>@shared``), so every node keeps its step, its observation and its errors.  A 125M
    model's q, k and v products from memory: 241 us as three launches, 199 as one."""
    out, i = [], 0
    while i < len(steps):
        j = i + 1
        while j < len(steps) and _sibling(steps[i], steps[j], backends, constants, rows):
            j += 1
        bind = getattr(backends[i], "bind_siblings", None)
        fn = bind([graph.nodes[s.index] for s in steps[i:j]]) if bind and j - i > 1 else None
        if fn is None:
            out.append(steps[i])
            i += 1
            continue
        lead, rest = steps[i], steps[i + 1:j]
        out.append(replace(lead, fn=fn, reads=(*lead.reads, *(s.reads[1] for s in rest)),
                           writes=(*lead.writes, *(s.writes[0] + _SHARED for s in rest))))
        out += [_passing_on(s) for s in rest]
        i = j
    return out


#: Nodes from a step on that :func:`_chains` offers a backend's ``bind_chain``.
CHAIN_WINDOW = 8


def _chains(steps: list[_Step], graph: Graph, backends: list[Backend], rows: RowPlan) -> list[_Step]:
    """Adjacent steps that one backend computes in one call (its optional ``bind_chain(nodes,
    kernels, backends)``: the numba backend's Rope, Rope, KvCache and Sdpa of a layer): the first step reads
    what the group reads from outside (:func:`chain_reads`) and computes every output, and each
    other step passes its own on (under ``<output>@shared``), so every node keeps its step and its
    observation; an error inside names its own node (:class:`ChainedNodeError`).  Only for steps
    that read their node's inputs as named, hold at most one KV cache, and all run once per
    segment in a batched pass or all once over every row.  Steps are one per node here, so a
    chain's nodes are consecutive: its node ``k`` is ``graph.nodes[first.index + k]``."""
    out, i = [], 0
    while i < len(steps):
        bind = getattr(backends[i], "bind_chain", None)
        end = i + CHAIN_WINDOW
        window = steps[i:end]
        found = bind(graph.nodes[i:end], [s.fn for s in window], backends[i:end]) if bind else None
        group = window[:found[0]] if found else []
        stateful = [s for s in group if s.kv_cache is not None]
        if (len(group) < 2 or len(stateful) > 1 or len({s.rows.per_segment for s in group}) > 1
                or any(s.reads != tuple(graph.nodes[s.index].inputs) for s in group)):
            out.append(steps[i])
            i += 1
            continue
        reads = chain_reads([graph.nodes[s.index] for s in group])
        held = stateful[0] if stateful else None
        lead_rows = NodeRows(group[0].rows.per_segment, tuple(rows.values.get(n) == ROWS for n in reads))
        out.append(replace(group[0], fn=found[1], reads=reads, rows=lead_rows,
                           writes=(*group[0].writes, *(w + _SHARED for s in group[1:] for w in s.writes)),
                           kv_cache=held and held.kv_cache, state=held.index if held else -1))
        out += [_passing_on(s) for s in group[1:]]
        i += len(group)
    return out


def _passing_on(step: _Step) -> _Step:
    """``step`` as the follower of a shared launch or a chain: its outputs, computed by the group's
    first step, passed on from ``<output>@shared``."""
    shared = tuple(w + _SHARED for w in step.writes)
    return replace(step, fn=_pass_on, reads=shared, frees=(*step.frees, *shared), kv_cache=None,
                   rows=NodeRows(False, (False,) * len(shared)))


def _sibling(first: _Step, step: _Step, backends: list[Backend], constants, rows: RowPlan) -> bool:
    """Whether ``step`` can join ``first``'s launch: one backend, one input tensor, a weight each,
    one output each, and both computed once over a batched pass's rows (a per-segment call slices
    its node's own inputs only)."""
    once = not (rows.nodes[first.index].per_segment or rows.nodes[step.index].per_segment)
    return (once and backends[step.index] is backends[first.index] and step.kv_cache is None and first.kv_cache is None
            and len(step.reads) == len(first.reads) == 2 and len(step.writes) == len(first.writes) == 1
            and step.reads[0] == first.reads[0] and step.reads[1] in constants and first.reads[1] in constants)


def _pass_on(inputs, ctx) -> tuple:
    return tuple(inputs)


#: The value under which a pass's wanted output rows reach the step that keeps them (:func:`_keep_rows`).
_WANTED = "@rows"


def _keep_rows(inputs, ctx) -> tuple:
    """The rows ``inputs[-1]`` of each of the other inputs."""
    wanted = inputs[-1]
    return tuple(a[wanted] for a in inputs[:-1])


def _output_tail(steps: list[_Step], graph: Graph, rows: RowPlan, constants) -> tuple[int, tuple[str, ...]] | None:
    """Where the last steps begin that take each row alone and make every output (the final norm
    and the vocabulary's product; the last layer's work after its attention), and what they read
    from before them: a pass that wants some rows' outputs only (a prompt's last) runs them on
    those rows.  A 512-token prompt of a 3B model with a 128256-token vocabulary spends 400 GFLOP
    in the vocabulary's product, 14% of the pass, for one row's logits.  None where the outputs
    need every row's work (a graph whose rows mix, an output made before such steps)."""
    if rows.reason is not None:
        return None
    k = len(steps)
    while k and not steps[k - 1].rows.per_segment and steps[k - 1].kv_cache is None:
        k -= 1
    while k < len(steps) and steps[k].fn is _pass_on:  # a shared launch or chain's followers stay with their lead
        k += 1
    tail = steps[k:]
    made = {w for step in tail for w in step.writes}
    if not tail or not set(graph.outputs) <= made:
        return None
    crossing = tuple(dict.fromkeys(n for step in tail for n in step.reads if n not in made and n not in constants))
    if any(rows.values.get(n) != ROWS for n in crossing):
        return None
    return k, crossing


def _prepared_weights(graph: Graph, weights: Mapping[str, Array]) -> tuple[dict[str, Array], dict[tuple[int, int], str]]:
    """Weights as the steps read them, and the renamed reads.

    A weight in a matmul-style slot (``OpSpec.weight_inputs``) stays in its stored form, quantized
    or not; a weight read anywhere else (norm scales, biases, tables) is widened to f32 once, here,
    under the key ``name@f32``.  Returns the constants and {(node, slot): key} for widened reads.
    """
    constants: dict[str, Array] = {}
    widened: dict[tuple[int, int], str] = {}
    for i, node in enumerate(graph.nodes):
        for slot, name in enumerate(node.inputs):
            if name not in graph.weights:
                continue
            if name not in weights:
                raise GraphValidationError(f"weight {name!r} (node {node.id}) was not loaded")
            w = weights[name]
            if slot in node.op.spec.weight_inputs or dtype_of(w).is_integer:
                constants[name] = w
            elif isinstance(w, QuantizedArray) or w.dtype != np.float32:
                key = f"{name}@f32"
                if key not in constants:
                    constants[key] = to_float(w)
                widened[(i, slot)] = key
            else:
                constants[name] = w
    return constants, widened


def _streamed(graph: Graph) -> list[str]:
    """The weights in matmul-style slots, which every pass reads whole, in the order it reads them."""
    names: dict[str, None] = {}
    for node in graph.nodes:
        for slot in node.op.spec.weight_inputs:
            if slot < len(node.inputs) and node.inputs[slot] in graph.weights:
                names[node.inputs[slot]] = None
    return list(names)


class GraphExecutor:
    """Run a graph: ``GraphExecutor(model).run({"tokens": ids})["logits"]``.

    ``model`` is a loaded :class:`dist_runtime.model.Model`, a path to a ``.model`` file, or a
    ``(graph, weights)`` pair.  ``backends`` lists backend names or objects in priority order (the
    first is the default; the CPU library is always last).  ``max_memory`` bounds the memory
    estimate (inputs + weights + peak intermediates), checked before the first run.
    :attr:`batch_invariant` says whether every node that mixes a pass's rows in one call (the
    matmul family, attention) runs on a backend that computes each row as it would alone, so that
    :meth:`run_batch` gives a session the same bits in any batch (the numba backend, the default).
    ``huge_pages``: copy the matrix weights into one buffer of 2 MiB pages (True), leave them as
    loaded (False), or decide by the system and their size (None; :mod:`dist_runtime.arena`);
    ``placement`` says which was done and why.  ``compiled_program``: run the longest run of steps
    the compiled program takes as one compiled call in passes without an ``observe``
    (:mod:`.backends.program`; the same bits), or every step from Python (False); ``program``
    says what it took, or why nothing.  ``kv_dtype``: what the sessions' KV caches keep K and V
    in, ``"f16"`` (half the memory, each row rounded to nearest even as numpy rounds it, whoever
    writes it: a session's bits are the same alone or batched) or ``"f32"``; None: the model's
    ``kv_dtype`` metadata, else f16.  ``numerics``: how the default backend's products multiply
    quantized weights (``"auto"``, ``"f32"``, ``"q8"``: :data:`.backends.NUMERICS`; None: auto),
    for ``backends=None`` only.
    ``release``: for a ``(graph, weights)`` pair whose weights are views of a file's map, what
    gives back a weight's pages once it is copied (the map's ``Model.release``; a loaded model or a
    path releases its own).
    """

    def __init__(self, model, backends: Sequence[str | Backend] | None = None,
                 max_memory: int | None = None, *, fuse: bool = True, seed: int = 0,
                 huge_pages: bool | None = None,
                 compiled_program: bool = True, kv_dtype: str | None = None, numerics: str | None = None,
                 release: Callable[[list[str]], object] | None = None) -> None:
        if huge_pages not in (None, True, False):
            raise TypeError(f"huge_pages= takes True, False or None (decide), not {huge_pages!r}")
        if compiled_program not in (True, False):
            raise TypeError(f"compiled_program= takes True or False, not {compiled_program!r}")
        graph, weights, declared_max, mapped = _open(model)
        self.kv_dtype = dtypes.kv_dtype(kv_dtype, mapped.metadata.get("kv_dtype") if mapped else None)
        self.backends = make_backends(backends, numerics)
        if numerics == "q8":
            _check_q8_kernels(graph, weights)
        checked = validate_graph(graph)  # structure and declared shapes; fusion keeps both
        self.warnings, specs = checked.warnings, checked.specs
        if fuse:  # a fused node that no backend in use takes is not formed (or is expanded back)
            from .fusion import backend_acceptor, fuse_graph

            graph = fuse_graph(graph, backend_acceptor(self.backends), specs=specs)
            if any(name not in specs for node in graph.nodes for name in node.outputs):
                specs = infer_shapes(graph)  # a fused node was expanded: its parts' names are new
        self.graph = graph
        self.max_memory = max_memory if max_memory is not None else declared_max
        self.assignments: list[Assignment] = assign_backends(graph, specs, self.backends)
        self.batch_invariant = all(a.backend.batch_invariant for node, a in zip(graph.nodes, self.assignments)
                                   if isinstance(node.op, _ROW_MIXING))
        self.rows: RowPlan = plan_rows(graph, specs)
        # each KvCache's row width (its k_new's last dim), for the rows a session's caches take
        self._kv_widths = [specs[node.inputs[0]].shape[-1] for node in graph.nodes if isinstance(node.op, KvCache)]
        constants, widened = _prepared_weights(graph, weights)
        streamed = _streamed(graph)
        # the mapped pages of each weight copied leave resident memory as soon as it is copied
        # (a page read again later is read from the file again: safe for any caller's views)
        self._constants, self.placement = pack(constants, streamed, huge_pages,
                                               mapped.release if mapped is not None else release)
        self._steps = self._bind(widened)
        self._program_steps, self.program = self._with_program() if compiled_program else (None, "not asked for")
        self._program_at = next((i for i, s in enumerate(self._program_steps or ()) if s.kv_cache is _PROGRAM), -1)
        self._some_rows = self._rows_steps(compiled_program)
        self._checked: set[tuple] = set()  # input signatures already shape-checked
        self._seed = seed
        self._sessions: dict[Hashable, Session] = {}

    def _bind(self, widened: dict[tuple[int, int], str]) -> list[_Step]:
        graph = self.graph
        steps = []
        for i, (node, assigned, frees) in enumerate(zip(graph.nodes, self.assignments, graph.index.frees)):
            reads = tuple(widened.get((i, s), name) for s, name in enumerate(node.inputs))
            kv = node.op if isinstance(node.op, KvCache) else None
            steps.append(_Step(i, assigned.backend.bind(node), reads, tuple(node.outputs), frees, kv,
                               self.rows.nodes[i]))
        backends = [a.backend for a in self.assignments]
        return _shared_launches(_chains(steps, graph, backends, self.rows), graph, backends, self._constants, self.rows)

    def _rows_steps(self, compiled_program: bool) -> tuple[list[_Step], list[_Step] | None] | None:
        """The steps of a pass that wants some rows' outputs only (:func:`_output_tail`): the
        steps, and with the compiled program ending where the tail begins; None without a tail."""
        found = _output_tail(self._steps, self.graph, self.rows, self._constants)
        if found is None:
            return None
        k, crossing = found
        head = self._steps[k]
        keep = _Step(head.index, _keep_rows, (*crossing, _WANTED), crossing, (_WANTED,), None,
                     NodeRows(False, (True,) * len(crossing) + (False,)))
        plain = [*self._steps[:k], keep, *self._steps[k:]]
        with_program = self._with_program(limit=k)[0] if compiled_program and self._program_steps else None
        if with_program is not None:
            at = next(i for i, s in enumerate(with_program) if s.index >= head.index and s.kv_cache is not _PROGRAM)
            with_program = [*with_program[:at], keep, *with_program[at:]]
        return plain, with_program

    def _with_program(self, limit: int | None = None) -> tuple[list[_Step] | None, str]:
        """The steps with the longest run the compiled program takes as one step
        (:mod:`.backends.program`; among the first ``limit`` steps), and what it took or why none
        (``inspect --plan``)."""
        rows = {}
        for t in (3, 5):  # values whose first dim follows the pass's rows: [T, width]
            try:
                rows[t] = infer_shapes(self.graph, {name: TensorSpec(tuple(t if d == -1 else d for d in spec.shape), spec.dtype)
                                                    for name, spec in zip(self.graph.input_names, self.graph.inputs)})
            except Exception as e:  # noqa: BLE001 -- a graph whose shapes need real inputs: no program
                return None, f"no compiled program: shapes not inferable ahead ({e})"
        specs = {n: spec for n, spec in rows[3].items()
                 if len(spec.shape) != 2 or (spec.shape[0], rows[5][n].shape[0]) == (3, 5)}
        found = program.build(self._steps, self.graph, specs, self._constants, [a.backend for a in self.assignments],
                              _pass_on, self.kv_dtype, limit=limit)
        if isinstance(found, str):
            return None, f"no compiled program: {found}"
        lo, hi, prog = found
        steps = self._steps[lo:hi]
        frees = tuple(n for step in steps for n in step.frees if n in prog.reads)
        step = replace(steps[0], fn=prog, reads=prog.reads, writes=prog.writes, frees=frees, kv_cache=_PROGRAM,
                       rows=NodeRows(True, (True,) * len(prog.reads)))  # a batched pass: over_segments
        return [*self._steps[:lo], step, *self._steps[hi:]], prog.describe()

    # -- sessions ------------------------------------------------------------------------------
    def session(self, sid: Hashable = DEFAULT_SESSION, *, seed: int | None = None) -> Session:
        """The state of session ``sid``, created on first use (``seed`` seeds its sampler)."""
        s = self._sessions.get(sid)
        if s is None:
            s = self._sessions[sid] = Session(self._seed if seed is None else seed, kv=KvStates(self.kv_dtype))
        return s

    def sessions(self) -> list[Hashable]:
        return list(self._sessions)

    def reset(self, session: Hashable | None = None) -> None:
        """Clear KV caches and position: of one session, or of every session when None."""
        targets = self._sessions.values() if session is None else [self.session(session)]
        for s in targets:
            s.reset()

    def kv_row_bytes(self) -> int:
        """Bytes one more row of a session takes in all its KV caches, as they keep rows."""
        return sum(2 * self.kv_dtype.nbytes((w,)) for w in self._kv_widths if isinstance(w, int) and w > 0)

    def set_kv_ceiling(self, session: Hashable, rows: int) -> None:
        """``session``'s KV caches grow to at most ``rows`` rows (the rows its request may reach,
        which the scheduler admitted it for; 0: no ceiling), unless a write itself goes past it."""
        self.session(session).kv.set_ceiling(rows)

    def detach_kv(self, session: Hashable) -> KvStates | None:
        """Forget ``session`` and hand over its KV states, buffers and all (for a prefix cache)."""
        s = self._sessions.pop(session, None)
        return None if s is None else s.kv

    def restore_kv(self, session: Hashable, states: Mapping, rows: int) -> None:
        """Start ``session`` from the first ``rows`` rows of ``states`` (another session's, as
        :meth:`detach_kv` gave them): each cache's rows copied, the position at ``rows``."""
        s = self.session(session)
        s.reset()
        for key, src in states.items():
            s.kv[key] = KvState(src.capacity, src.dtype, s.kv.ceiling)
            s.kv[key].copy_prefix(src, rows)
        s.pos = rows

    def close_session(self, session: Hashable) -> None:
        """Forget a session and free its KV caches."""
        self._sessions.pop(session, None)

    def memory(self) -> dict[str, int]:
        """This process's resident bytes now and at peak (:func:`.arena.process_memory`) and every
        session's KV caches' bytes: ``kv_in_use`` (the rows held) and ``kv_reserved`` (what their
        buffers can hold before they grow)."""
        held = [state.nbytes() for s in self._sessions.values() for state in s.kv.values()]
        return {**(process_memory() or {}), "kv_in_use": sum(h for h, _ in held),
                "kv_reserved": sum(r for _, r in held)}

    def position(self, session: Hashable = DEFAULT_SESSION) -> int:
        return self.session(session).pos

    @property
    def past_seq_len(self) -> int:
        """The default session's position: rows its KV caches hold (the seed's past_seq_len)."""
        return self.position(DEFAULT_SESSION)

    # -- running -------------------------------------------------------------------------------
    def _check_inputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = self.graph.input_names
        missing = [n for n in names if n not in inputs]
        extra = [n for n in inputs if n not in names]
        if missing or extra:
            raise GraphValidationError(f"run() needs inputs {names}; missing {missing}, unexpected {extra}")
        arrays = {}
        for name, declared in zip(names, self.graph.inputs):
            a = np.asarray(inputs[name])
            want = declared.dtype.numpy
            if a.dtype != want:
                if not np.can_cast(a.dtype, want, "same_kind"):
                    raise GraphValidationError(f"input {name!r} is {a.dtype}, the graph declares {declared}")
                a = a.astype(want)
            arrays[name] = a
        signature = tuple((n, a.shape) for n, a in arrays.items())
        if signature not in self._checked:  # -1 dims resolved from the actual inputs, once per shape
            actual = {n: TensorSpec(a.shape, dtype_of(a)) for n, a in arrays.items()}
            specs = infer_shapes(self.graph, actual)
            if self.max_memory is not None:
                check_memory(estimate_memory(self.graph, specs), self.max_memory, "max_memory",
                             {n: a.shape for n, a in arrays.items()})
            self._checked.add(signature)
        return arrays

    def run(self, inputs: Mapping[str, np.ndarray], *, session: Hashable = DEFAULT_SESSION,
            pos: int | None = None, observe=None, rows: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """Run the graph once for ``session``; returns the graph outputs by name.

        ``pos`` (the session's position by default) is injected as the ``pos`` tensor.  A run
        over T new rows advances the session's position by T (the rows its KV caches gained; 1 in
        a graph without KvCache, as in the seed).  ``observe(node, outputs, live)``, if given, is
        called after every node with the names still live (for tests and tracing).  ``rows``: the
        rows whose outputs are wanted (a prompt's last, for its logits), in order; the outputs
        then hold those rows only, each bitwise as in a pass that makes them all, and the steps
        after the last that mixes rows run on those rows alone (:func:`_output_tail`).
        """
        s = self.session(session)
        if pos is not None:
            s.pos = pos
        values: dict[str, Array] = {**self._constants, **self._check_inputs(inputs)}
        values[POS] = np.array([s.pos], np.float32)
        plain = KernelContext(rng=s.rng, pos=s.pos)  # one per run: only a KvCache step needs its own
        program = observe is None and bool(self._program_steps)
        steps, cut = self._for_rows(values, rows, self._program_steps if program else self._steps, program)
        self._walk(values, lambda step: step.fn([values[n] for n in step.reads],
                                                plain if step.kv_cache is None else self._context(step, s)), observe,
                   steps)
        self._advance(s)
        return self._outputs(values, None if cut else rows)

    def _for_rows(self, values: dict, rows: Sequence[int] | None, steps: list[_Step],
                  program: bool) -> tuple[list[_Step], bool]:
        """The steps of a pass whose outputs are wanted for ``rows`` only, and whether they make
        those rows alone: with the tail on them (given as ``values[_WANTED]``), or ``steps`` (all
        rows wanted, or no tail to cut: :meth:`_outputs` cuts the outputs).  ``program``:
        ``steps`` hold the compiled program."""
        if rows is None:
            return steps, False
        wanted = np.asarray(rows, np.int64)
        total = len(values[self.graph.input_names[0]])
        if wanted.ndim != 1 or not len(wanted) or wanted.min() < 0 or wanted.max() >= total:
            raise GraphValidationError(f"rows= takes row numbers of this pass's {total} rows, got {list(rows)}")
        if self._some_rows is None or np.array_equal(wanted, np.arange(total)):
            return steps, False
        plain, with_program = self._some_rows
        if program and with_program is None:  # the program alone takes the whole pass: cut after
            return steps, False
        values[_WANTED] = wanted
        return (with_program if program else plain), True

    def _outputs(self, values: dict, rows: Sequence[int] | None) -> dict[str, np.ndarray]:
        """The graph's outputs: ``rows`` of them where the pass made them all."""
        out = {name: values[name] for name in self.graph.outputs}
        if rows is None:
            return out
        wanted = np.asarray(rows, np.int64)
        return {name: v if np.array_equal(wanted, np.arange(len(v))) else v[wanted] for name, v in out.items()}

    def run_batch(self, inputs: Mapping[str, np.ndarray], segments: Sequence[Segment],
                  rows: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """One pass over several sessions' rows (``dist_runtime.batched_pass``): ``inputs`` hold every
        segment's rows concatenated along axis 0, in segment order; so do the outputs (``rows``:
        those rows only, as :meth:`run`).  Each session advances as by :meth:`run`; a segment's rows
        come out bitwise as they would alone when the backends are batch-invariant
        (``batch_invariant``).  One segment is :meth:`run`."""
        if len(segments) == 1:
            seg = segments[0]
            return self.run(inputs, session=seg.session, pos=seg.pos, rows=rows)
        self._check_segments(inputs, segments)
        sessions = [self.session(seg.session) for seg in segments]
        for seg, s in zip(segments, sessions):
            if seg.pos is not None:
                s.pos = seg.pos
        values: dict[str, Array] = {**self._constants, **self._check_inputs(inputs)}
        values[POS] = PerSegment(np.array([s.pos], np.float32) for s in sessions)
        cuts = offsets(segments)
        takes = self._program_steps and self._program_steps[self._program_at].fn.takes(
            cuts[-1].stop, [(s.kv, s.pos) for s in sessions])
        steps, cut = self._for_rows(values, rows, self._program_steps if takes else self._steps, bool(takes))
        self._walk(values, lambda step: self._call_segments(step, values, sessions, cuts), None, steps)
        for s in sessions:
            self._advance(s)
        return self._outputs(values, None if cut else rows)

    def _check_segments(self, inputs: Mapping[str, np.ndarray], segments: Sequence[Segment]) -> None:
        if self.rows.reason is not None:
            raise GraphValidationError(f"this graph runs one session per pass: {self.rows.reason}")
        ids = [seg.session for seg in segments]
        if len(set(ids)) != len(ids):
            raise GraphValidationError(f"a batched pass takes each session once, got {ids}")
        if not segments or any(seg.rows < 1 for seg in segments):
            raise GraphValidationError(f"a batched pass needs segments of at least one row, got {list(segments)}")
        total = sum(seg.rows for seg in segments)
        for name in self.graph.input_names:
            rows = np.shape(inputs[name])[0] if name in inputs and np.ndim(inputs[name]) else None
            if rows is not None and rows != total:
                raise GraphValidationError(f"input {name!r} has {rows} rows, the segments {total}")

    def _walk(self, values: dict, call, observe, steps: list[_Step] | None = None) -> None:
        """Every step in order, ``call(step)`` computing its outputs; an exception inside a step
        leaves as the project's error naming that step's node."""
        step = None
        try:
            for step in steps or self._steps:
                outs = call(step)
                for name, value in zip(step.writes, outs):
                    values[name] = value
                for name in step.frees:
                    del values[name]
                if observe is not None:
                    node = self.graph.nodes[step.index]
                    observe(node, outs[:len(node.outputs)], values.keys())
        except ChainedNodeError as e:  # inside a chain: the node that failed, on what it read
            node = self.graph.nodes[step.index + e.offset]
            raise self._node_error(e.error, step.index + e.offset, dict(zip(node.inputs, e.inputs))) from e.error
        except Exception as e:  # noqa: BLE001 -- re-raised as the project's error, naming the node
            node = self.graph.nodes[step.index]
            raise self._node_error(e, step.index, {n: values.get(r) for n, r in zip(node.inputs, step.reads)}) from e

    def _call_segments(self, step: _Step, values: Mapping[str, Array], sessions: list[Session],
                       cuts: list[slice]) -> tuple:
        """A step of a batched pass: once over every row, or once per segment (outputs joined
        along the rows, or kept per segment)."""
        rows = step.rows
        args = [values[n] for n in step.reads]
        if not rows.per_segment:
            return step.fn(args, _PLAIN)
        many = getattr(step.fn, "over_segments", None)  # every segment in one call, when it can
        done = many(args, cuts, [self._context(step, s) for s in sessions]) if many else None
        if done is not None:
            return done
        parts = []
        for i, (s, cut) in enumerate(zip(sessions, cuts)):
            mine = [a[i] if isinstance(a, PerSegment) else a[cut] if sliced else a
                    for a, sliced in zip(args, rows.sliced)]
            parts.append(step.fn(mine, self._context(step, s)))
        sorts = self.rows.values  # of each output, by name (a chain's first step writes several nodes')
        return tuple(PerSegment(p[j] for p in parts) if sorts.get(name.removesuffix(_SHARED)) == SEGMENTED
                     else np.concatenate([p[j] for p in parts]) for j, name in enumerate(step.writes))

    @staticmethod
    def _context(step: _Step, s: Session) -> KernelContext:
        if step.kv_cache is _PROGRAM:  # the program keeps its KV caches' states itself
            return KernelContext(state=s.kv, rng=s.rng, pos=s.pos)
        state = None if step.kv_cache is None else KvState.held_in(s.kv, step.state_key, step.kv_cache)
        return KernelContext(state=state, rng=s.rng, pos=s.pos)

    @staticmethod
    def _advance(s: Session) -> None:
        """After a pass: the session's position is the rows its KV caches hold (+1 without any)."""
        held = {state.length for state in s.kv.values()}
        if len(held) > 1:
            raise GraphValidationError(f"KvCache nodes of one run disagree on the rows they hold ({sorted(held)})")
        s.pos = held.pop() if held else s.pos + 1

    def _node_error(self, error: Exception, index: int, read: Mapping[str, Array]) -> DistRuntimeError:
        """``error``, raised while running node ``index`` on ``read`` (its inputs by name), as the
        project's error naming the node, its op and its inputs (as torch.fx's "While executing
        ..." does); the type is kept when it is already one of the project's errors."""
        node = self.graph.nodes[index]
        seen = ", ".join(f"{name} {_spec_text(read.get(name))}" for name in node.inputs)
        message = f"node {node.id} ({node.op_name}) reading {seen or 'nothing'}: {error}"
        if isinstance(error, DistRuntimeError):
            try:
                return type(error)(message)
            except TypeError:  # a subclass whose constructor takes more than a message
                pass
        return KernelError(f"{message} ({type(error).__name__})")

    def held_weights(self, weights: Mapping[str, Array]) -> dict[str, Array]:
        """``weights`` with each one this executor holds a copy of (``placement``) replaced by
        that copy, so that the caller can drop the originals."""
        return {n: self._constants.get(n, w) if n in self.graph.weights else w for n, w in weights.items()}

    # -- reporting -----------------------------------------------------------------------------
    def last_rows(self) -> str:
        """What a pass that wants some rows' outputs only runs on those rows (``inspect --plan``)."""
        if self._some_rows is None:
            stop = next((self.graph.nodes[s.index] for s in reversed(self._steps)
                         if s.rows.per_segment or s.kv_cache is not None), None)
            why = (f"node {stop.id} ({stop.op_name}) runs per session" if stop is not None and self.rows.reason is None
                   else "no step takes each row alone up to the outputs")
            return f"every row makes the outputs: {why}"
        plain = self._some_rows[0]
        k = next(i for i, s in enumerate(plain) if s.fn is _keep_rows)
        nodes = [self.graph.nodes[s.index] for s in plain[k + 1:] if s.fn is not _pass_on]
        return (f"a pass wanting each session's last row runs nodes {nodes[0].id}..{nodes[-1].id} "
                f"({', '.join(n.op_name for n in nodes)}) on those rows only")

    def plan(self) -> list[dict]:
        """Per node: id, op, backend and the reason it was chosen, its rows' kind in a batched
        pass, and the shared launch it is part of ("" if none) (``inspect --plan``)."""
        launches = self._launches()
        return [{"id": n.id, "op": n.op_name, "backend": a.backend.name, "reason": a.reason,
                 "rows": n.op.spec.row_kind(n.op), "launch": launches.get(i, "")}
                for i, (n, a) in enumerate(zip(self.graph.nodes, self.assignments))]

    def _launches(self) -> dict[int, str]:
        """What the plan says of the shared launches and chains (:func:`_shared_launches`,
        :func:`_chains`), by node position; a node assigned elsewhere than the group's first (a
        KvCache of the CPU library's in the numba backend's chain) is told where it runs."""
        notes, lead = {}, None
        for step in self._steps:
            if step.fn is not _pass_on:
                lead = step
                continue
            runs = self.assignments[lead.index].backend
            where = "" if self.assignments[step.index].backend is runs else f", on {runs.name}"
            notes[step.index] = f"launched with node {self.graph.nodes[lead.index].id}{where}"
            ids = notes.get(lead.index, "launched with node(s)")
            notes[lead.index] = f"{ids} {self.graph.nodes[step.index].id}"
        return notes

    def batching(self) -> str:
        """Whether sessions' rows can share a pass, and if not, why (``inspect --plan``)."""
        if self.rows.reason is not None:
            return f"one session per pass: {self.rows.reason}"
        return "the rows of several sessions share each pass (row-independent ops run once over all)"


def _spec_text(value) -> str:
    if value is None:
        return "(absent)"
    try:
        return str(TensorSpec(tuple(value.shape), dtype_of(value)))
    except Exception:  # noqa: BLE001 -- describing a value must not hide the error being reported
        return type(value).__name__


def _check_q8_kernels(graph: Graph, weights: Mapping) -> None:
    """``--numerics q8`` asks every product for Q8_0 activations: a block type without such a
    kernel (its products would run f32 in the CPU library) is refused, naming it, before anything
    is copied."""
    from .backends.compiled import PRODUCTS

    for node in graph.nodes:
        for i in WEIGHT_SLOTS.get(type(node.op), ()):
            w = weights.get(node.inputs[i]) if i < len(node.inputs) else None
            kind = dtype_of(w) if w is not None else None
            if kind is not None and kind.is_quantized and kind not in PRODUCTS:
                raise GraphValidationError(
                    f"--numerics q8: weight {node.inputs[i]!r} is {kind.name}, which has no product with Q8_0 "
                    f"activations (the CPU library multiplies it in f32); use --numerics auto or f32")


def _open(model):
    """(graph, weights, declared max_memory, the Model whose map holds the weights, else None)."""
    if isinstance(model, (str, os.PathLike, Path)):
        from .model import load_model

        model = load_model(model)
    if isinstance(model, tuple):
        graph, weights = model
        return graph, weights, None, None
    if model.graph is None:
        raise GraphValidationError(f"{model.path} has no graph section: there is nothing to run")
    weights = {n: model.tensor(n) for n in model.graph.weights}
    return model.graph, weights, model.metadata.get("max_memory"), model

"""The project's exception hierarchy.

Everything the runtime raises on purpose derives from :class:`DistRuntimeError`, so a caller can
catch one type.  The subclasses say *where* the problem is:

* :class:`ModelFormatError` -- the bytes on disk (or on the wire, for a graph blob) are malformed:
  truncated, a count that runs past the end, an unknown tag, invalid UTF-8, overlapping tensors...
* :class:`GraphValidationError` -- the bytes were well formed, but the graph they describe is not
  valid: a name consumed before it is produced, a cycle, a shape mismatch, too little memory...

Messages name what is wrong and where (byte offset, node id, tensor name), so a person can act.
"""

from __future__ import annotations


class DistRuntimeError(Exception):
    """Base class of every error the runtime raises deliberately."""


class ModelFormatError(DistRuntimeError):
    """Malformed bytes: a .model container, a ~~~graph blob, a tensors index or a TOML section."""


class GraphValidationError(DistRuntimeError):
    """A well-formed graph that breaks an invariant (ordering, naming, shapes, memory)."""


class KernelError(DistRuntimeError):
    """A run-time fact the shapes could not show (a dim that was unknown at load time, a token id
    out of range, a singular matrix).  From the executor, the message names the node, its op and
    its inputs' names and shapes; from a kernel called directly, it starts with the op's name."""


class InfeasiblePlanError(DistRuntimeError):
    """No pipeline plan satisfies the request: a node larger than every budget, budgets that fit
    the total but no contiguous split, a context too long for the budgets, more stages than nodes.

    ``kind`` names the case for programs (``"node_too_large"``, ``"total_too_large"``,
    ``"contiguity"``, ``"context"``, ``"no_machines"``, ``"empty_graph"``, ``"more_stages_than_nodes"``,
    ``"too_large"``)
    and ``details`` holds its numbers."""

    def __init__(self, message: str, kind: str = "infeasible", details: dict | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.details = dict(details or {})


class TransportError(DistRuntimeError):
    """A frame received from another process is malformed or over a limit; nothing was built
    from it, and the receiver keeps serving other sessions."""


class SamplingError(DistRuntimeError):
    """Sampling settings that contradict each other or are out of range; the message says which."""


class ClusterError(DistRuntimeError):
    """The Ray cluster cannot be reached, joined or used as asked: an address that is not one,
    nothing listening there, a missing token, or resources no node has."""


class StageUnavailableError(DistRuntimeError):
    """A pipeline stage did not answer within its deadline, or kept failing after recovery."""

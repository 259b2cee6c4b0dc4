"""Running a model as a pipeline of Ray actors, one per stage of a partitioner plan.

Modules, by what they hold:

* ``subgraph``  -- cutting a plan's stage out of the graph: inputs, outputs, forwarded tensors, weights;
* ``weights``   -- where a stage's weights come from (the file, or the object store) and proof of
  what it holds;
* ``stage``     -- the stage: decode a message, run its GraphExecutor, encode the reply (the Ray actor);
* ``channels``  -- how a step travels through the stages (chained object refs, a compiled graph);
* ``options``   -- ``StageOptions``: what a deployment asks for (CPUs, threads, nodes, weights source);
* ``deploy``    -- placing the actors (CPUs, BLAS threads, nodes) and loading their weights;
* ``coordinator`` -- sessions, positions, reset, prefill and decode with many sessions in flight
  (the pipeline's engine for ``dist_runtime.engine``; sampling is ``dist_runtime.sampling``);
* ``telemetry`` -- per stage and step timings, run figures, the stats table and the SVG timeline;
* ``cluster``   -- an embedded local Ray, or an existing cluster;
* ``launch``    -- ``Pipeline``: all of the above behind one object;
* ``cli``       -- the ``dist-runtime pipeline`` command.

Imports are lazy: ``import dist_runtime.pipeline`` does not import Ray.
"""

from __future__ import annotations

from .. import _lazy_exports

_LAZY = {
    "Pipeline": ("dist_runtime.pipeline.launch", "Pipeline"),
    "make_plan": ("dist_runtime.pipeline.launch", "make_plan"),
    "StageOptions": ("dist_runtime.pipeline.options", "StageOptions"),
    "Request": ("dist_runtime.engine", "Request"),
    "Coordinator": ("dist_runtime.pipeline.coordinator", "Coordinator"),
    "Sampling": ("dist_runtime.sampling", "Sampling"),
    "cut_stages": ("dist_runtime.pipeline.subgraph", "cut_stages"),
    "stages_for_plan": ("dist_runtime.pipeline.subgraph", "stages_for_plan"),
}

__all__ = list(_LAZY)


__getattr__ = _lazy_exports(__name__, _LAZY)

"""The single-process reference: the same requests run by one ``GraphExecutor``.

The pipeline must give the same answers as this (logits within 1e-5, identical tokens); the tests
and ``benchmarks/bench_pipeline.py`` compare against it, and ``dist-runtime pipeline --check``
runs it after the pipeline to show they agree.  Sessions are interleaved step by step here too
(round robin), which is what the pipeline does, so a cross-session leak would show.
"""

from __future__ import annotations

from typing import Hashable, Iterable

import numpy as np

from .coordinator import Request
from .subgraph import driver_outputs


def reference_tokens(executor, requests: Iterable[Request]) -> dict[Hashable, list[int]]:
    """Generated tokens per session, sampling with the same settings and seeds as the pipeline."""
    _, logits_name = driver_outputs(executor.graph)
    input_name = executor.graph.input_names[0]
    results: dict[Hashable, list[int]] = {}
    live = []
    for req in requests:
        if not req.resume:
            executor.reset(req.session)
        results[req.session] = []
        live.append((req, req.sampling.rng(), [list(req.prompt)]))
    while live:
        for item in list(live):
            req, rng, feed = item
            out = results[req.session]
            logits = executor.run({input_name: np.asarray(feed[0], np.int32)}, session=req.session)[logits_name]
            token = req.sampling.choose(logits, rng)
            out.append(token)
            feed[0] = [token]
            if len(out) >= req.max_new_tokens or token in req.stop:
                live.remove(item)
    return results

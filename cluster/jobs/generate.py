"""Cluster job: generate with a model split into pipeline stages (``dist-runtime pipeline``).

Two ways to run it::

    # the cluster launcher copies this file to the head node and runs it there
    ray submit cluster/local.yaml cluster/jobs/generate.py -- /models/llama.model --stages 2 --stats

    # the jobs API uploads the working directory (the project) and runs it on the cluster
    ray job submit --working-dir . -- python cluster/jobs/generate.py /models/llama.model --stages 2 --stats

Every option of ``dist-runtime pipeline`` applies (``--help``).  The job joins the cluster it runs
on: ``RAY_ADDRESS`` (set by the jobs API), else ``--address auto``.  ``--example`` first writes
the small random-weight Llama to MODEL if that file does not exist -- a smoke test that needs no
model on the nodes (the stages then receive their weights through Ray's object store, unless
MODEL is on a shared file system).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _import_project() -> None:
    """Under ``ray job submit --working-dir .`` the project is the working directory, but Python
    puts this script's own directory first on sys.path, not the working directory.  (Each job
    script has its own copy: ``ray submit`` uploads the script alone.)"""
    try:
        import dist_runtime  # noqa: F401 -- installed on the node
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        if (root / "dist_runtime").is_dir():
            sys.path.insert(0, str(root))
        else:
            sys.exit("error: dist_runtime is not installed on this node: run the cluster's setup "
                     "commands (cluster/local.yaml), or submit with --working-dir pointing at the project")


def main(argv: list[str]) -> int:
    _import_project()
    from dist_runtime.cli import main as cli_main

    if "--example" in argv:
        argv = [a for a in argv if a != "--example"]
        model = next((a for a in argv if not a.startswith("-")), None)
        if model and not Path(model).exists():
            from dist_runtime.examples import LlamaConfig, llama_graph, llama_metadata, llama_weights
            from dist_runtime.model import save_model

            cfg = LlamaConfig(vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, ffn=128)
            Path(model).parent.mkdir(parents=True, exist_ok=True)
            save_model(model, llama_graph(cfg), llama_weights(cfg), llama_metadata(cfg)).close()
            print(f"wrote the example model to {model}")
    if "--address" not in argv and not os.environ.get("RAY_ADDRESS"):
        argv = [*argv, "--address", "auto"]  # a job runs on a cluster, never on an embedded Ray
    return cli_main(["pipeline", *argv])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

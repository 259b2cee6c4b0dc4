"""What both job scripts do first: make ``dist_runtime`` importable on the node (this file sits
beside them, and a script's own directory is first on ``sys.path``)."""

from __future__ import annotations

import sys
from pathlib import Path


def import_project() -> None:
    """Under ``ray job submit --working-dir .`` the project is the working directory, but Python
    puts this script's own directory first on sys.path, not the working directory."""
    try:
        import dist_runtime  # noqa: F401 -- installed on the node
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        if (root / "dist_runtime").is_dir():
            sys.path.insert(0, str(root))
        else:
            sys.exit("error: dist_runtime is not installed on this node: run the cluster's setup "
                     "commands (cluster/local.yaml), or submit with --working-dir pointing at the project")

"""The import graph of the project's own modules has no cycle, and ``dist-runtime --help`` stays
light (no numpy, no Ray).

Every ``import`` statement counts -- at module level, inside functions and under
``TYPE_CHECKING`` alike -- since each is a dependency a reader has to hold in mind.  A parent
package's ``__init__`` is not counted as a dependency of its submodules (Python runs it first
whatever the code says), only what a file imports by name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
#: repository folder -> installed package name
TREES = {"dist_runtime": "dist_runtime", "kernels": "dist_runtime.kernels", "partitioner": "dist_runtime.partitioner"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in TREES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def import_graph() -> nx.DiGraph:
    modules = _modules()
    g = nx.DiGraph()
    for name, path in modules.items():
        g.add_node(name)
        g.add_edges_from((name, target) for target in _imports(name, path, modules))
    return g


def test_the_import_graph_has_no_cycle():
    g = import_graph()
    assert g.number_of_nodes() > 50 and g.number_of_edges() > 100  # the walk found the project
    cycles = list(nx.simple_cycles(g, length_bound=8))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join([*c, c[0]]) for c in cycles[:20])


#: The layers, lowest first: a module imports only from its own layer and the layers below it.  A
#: module belongs to the layer of the longest name in the table that is it or a package holding it;
#: every module the table does not name is in the first layer.  The single-process engine runs a
#: model in one process; the pipeline splits it into stages with that engine inside each; the
#: server serves either; the commands drive all of them.
LAYERS = [
    ("foundation", ["dist_runtime"]),  # IR, .model files, kernels, importers, partitioner, helpers
    ("backends", ["dist_runtime.backends"]),
    ("engine", ["dist_runtime.batched_pass", "dist_runtime.fusion", "dist_runtime.executor", "dist_runtime.sampling",
                "dist_runtime.requests", "dist_runtime.scheduling", "dist_runtime.engine"]),
    ("pipeline", ["dist_runtime.pipeline", "dist_runtime.embed"]),
    ("serve", ["dist_runtime.serve"]),
    ("commands", ["dist_runtime.cli", "dist_runtime.demo"]),
]


def layer_of(module: str) -> int:
    owners = [(len(name), rank) for rank, (_, names) in enumerate(LAYERS) for name in names
              if module == name or module.startswith(name + ".")]
    return max(owners)[1]


def test_every_import_points_to_the_same_layer_or_below():
    g = import_graph()
    for _, names in LAYERS:  # a renamed module must not leave its layer's entry naming nothing
        missing = [n for n in names if not any(m == n or m.startswith(n + ".") for m in g.nodes)]
        assert not missing, f"LAYERS names modules that do not exist: {missing}"
    upward = sorted((a, b) for a, b in g.edges if layer_of(b) > layer_of(a))
    assert not upward, "imports against the layer order (importer -> imported):\n" + "\n".join(
        f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})" for a, b in upward)


def test_help_imports_neither_numpy_nor_ray():
    code = ("import sys; from dist_runtime.cli import build_parser; build_parser(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'ray', 'numba', 'networkx', 'msgpack'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
    help_ = subprocess.run([sys.executable, "-m", "dist_runtime.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0 and "generate" in help_.stdout and "pipeline" in help_.stdout

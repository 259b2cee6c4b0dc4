"""The wheel installs one top-level package, ``dist_runtime``, holding every package of the tree.

``kernels/`` and ``partitioner/`` sit at the repository's top (they are the design) but install as
``dist_runtime.kernels`` and ``dist_runtime.partitioner``: both names are taken on PyPI, and a
top-level ``kernels`` would be overwritten by (or overwrite) another distribution's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds the wheel

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"kernels": "dist_runtime/kernels", "partitioner": "dist_runtime/partitioner"}


def _source_packages() -> set[str]:
    """Every package of the tree, as the wheel must lay it out (``a/b`` for ``a.b``)."""
    out = set()
    for top in ("dist_runtime", *MAPPED):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).as_posix()
            head, _, rest = rel.partition("/")
            out.add(MAPPED.get(head, head) + (f"/{rest}" if rest else ""))
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # A copy of what the wheel is built from: setuptools builds in the source folder, and two test
    # workers building in the same checkout at once would share its build/ folder.
    src = out / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "tests", "benchmarks",
                                                             "*.egg-info", "__pycache__", "out"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "-w", str(out), str(src)], check=True, capture_output=True, timeout=300)
    (path,) = out.glob("dist_runtime-*.whl")
    return zipfile.ZipFile(path)


def test_the_only_top_level_package_is_dist_runtime(wheel):
    tops = {n.split("/")[0] for n in wheel.namelist() if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"dist_runtime"}


def test_every_package_of_the_tree_is_in_the_wheel(wheel):
    inits = {n.rsplit("/", 1)[0] for n in wheel.namelist() if n.endswith("/__init__.py")}
    assert inits == _source_packages()
    assert "dist_runtime/data/minilm_reference.npz" in wheel.namelist()


def test_the_installed_names_resolve_to_the_repository_folders():
    import dist_runtime.kernels
    import dist_runtime.partitioner

    assert Path(dist_runtime.kernels.__file__).parent == ROOT / "kernels"
    assert Path(dist_runtime.partitioner.__file__).parent == ROOT / "partitioner"


def test_a_checkout_works_without_installing():
    """``ray job submit --working-dir .`` ships the checkout, not an install: without the
    editable finder (``-S``: no site processing), the checkout alone resolves the mapped names."""
    import sysconfig

    env = {"PYTHONPATH": f"{ROOT}{':'}{sysconfig.get_paths()['purelib']}", "PATH": "/usr/bin:/bin"}
    code = ("import dist_runtime.kernels.quant as q, dist_runtime.partitioner.planner as p; "
            "print(q.__file__); print(p.__file__)")
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True,
                         cwd="/", timeout=120, check=True).stdout.split()
    assert out == [str(ROOT / "kernels" / "quant.py"), str(ROOT / "partitioner" / "planner.py")]

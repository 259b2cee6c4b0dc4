"""Shared fixtures: small valid example graphs, weights and .model files.

``tiny_decoder()`` is a 1-layer Llama-style decoder (TokenEmbed -> RmsNorm -> Matmul q/k/v ->
Rope -> KvCache -> Sdpa -> Matmul o -> Add -> RmsNorm -> Matmul gate/up -> SwiGlu -> Matmul down
-> Add -> RmsNorm -> Matmul lm_head -> Sample) with seeded random f32 weights and tiny dims
(vocab 32, hidden 16, 2 heads of 8, 1 KV head, FFN 32), built by ``dist_runtime.examples``.
"""

from __future__ import annotations

import numpy as np
import pytest

from dist_runtime.dtypes import DType
from dist_runtime.examples import LlamaConfig, llama_graph, llama_metadata, llama_weights
from dist_runtime.ir.graph import Graph, Node, TensorSpec
from dist_runtime.ir.ops import Matmul, RmsNorm, Sample, TokenEmbed
from dist_runtime.tensor import QuantizedArray

#: The tiny decoder's dimensions.
TINY_CONFIG = LlamaConfig(vocab=32, hidden=16, layers=1, heads=2, kv_heads=1, ffn=32)
#: A memory budget the tiny decoder fits comfortably.
TINY_MAX_MEMORY = 16 * 2**20


def tiny_decoder(seed: int = 0) -> tuple[Graph, dict[str, np.ndarray], dict]:
    """(graph, weights, metadata) of the 1-layer tiny decoder; weights in insertion order."""
    graph = llama_graph(TINY_CONFIG)
    weights = llama_weights(TINY_CONFIG, seed=seed)
    metadata = llama_metadata(TINY_CONFIG) | {"max_memory": TINY_MAX_MEMORY}
    return graph, weights, metadata


def q8_0_blocks(x: np.ndarray) -> QuantizedArray:
    """``x`` (f32, last dim a multiple of 32) quantized to GGML Q8_0 blocks by the gguf package."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    data = gguf.quants.quantize(np.ascontiguousarray(x, np.float32), GGMLQuantizationType.Q8_0)
    return QuantizedArray(data, DType.Q8_0, tuple(x.shape))


def mini_graph(seed: int = 0) -> tuple[Graph, dict[str, object], dict]:
    """A 4-node graph (TokenEmbed -> RmsNorm -> Matmul with a Q8_0 lm_head -> Sample) with three
    small weights: the smallest file with every section, for fuzzing."""
    rng = np.random.default_rng(seed)
    vocab, hidden = 8, 32
    nodes = [
        Node(0, TokenEmbed(), ["tokens", "model.embed_tokens.weight"], ["h"]),
        Node(1, RmsNorm(eps=1e-5), ["h", "model.norm.weight"], ["n"], backend_hint=0),
        Node(2, Matmul(), ["n", "lm_head.weight"], ["logits"]),
        Node(3, Sample(method=0), ["logits"], ["next_token"]),
    ]
    graph = Graph(nodes, [TensorSpec((-1,), DType.I32)], ["logits", "next_token"], {})
    weights = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, hidden)).astype(np.float32),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": q8_0_blocks(rng.standard_normal((vocab, hidden)).astype(np.float32)),
    }
    metadata = {"name": "mini", "architecture": "test", "max_memory": 2**20}
    return graph, weights, metadata


@pytest.fixture
def decoder():
    """(graph, weights, metadata) of the tiny decoder."""
    return tiny_decoder()


@pytest.fixture
def decoder_path(tmp_path):
    """Path of the tiny decoder saved as a .model file (binary graph)."""
    from dist_runtime.model import save_model

    graph, weights, metadata = tiny_decoder()
    path = tmp_path / "tiny.model"
    save_model(path, graph, weights, metadata).close()
    return path


def save_example(path, cfg: LlamaConfig, seed: int = 0):
    """Write the example Llama of ``cfg`` (seeded random weights) as a .model at ``path``."""
    from dist_runtime.model import save_model

    save_model(path, llama_graph(cfg), llama_weights(cfg, seed=seed), llama_metadata(cfg)).close()
    return path


def wait_dead(actor, pid: int, seconds: float = 60.0) -> None:
    """``ray.kill`` returns before the actor is gone, and Ray calls the actor dead a moment before
    its process (and so its direct links) is: wait for both."""
    import os
    import time

    import ray

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=seconds)
        except ray.exceptions.RayActorError:
            try:
                os.kill(pid, 0)  # the stage runs on this machine in these tests
            except ProcessLookupError:
                return
        time.sleep(0.05)
    raise AssertionError("the killed actor is still running")


@pytest.fixture(scope="module")
def local_ray():
    """An embedded Ray with 4 CPUs (so stages of 0.5 CPU fit) for one test module, no dashboard;
    a module asks for it with ``pytestmark = pytest.mark.usefixtures("local_ray")``."""
    ray = pytest.importorskip("ray")
    from dist_runtime.pipeline.cluster import connect

    assert not ray.is_initialized()
    connect(num_cpus=4)
    yield
    ray.shutdown()


#: The pipeline tests' model: 4 layers, so 1 to 4 stages each get whole layers.
PIPELINE_CFG = LlamaConfig(vocab=96, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64)


@pytest.fixture(scope="module")
def pipeline_model(tmp_path_factory):
    """``PIPELINE_CFG`` with seeded weights, written once per test module."""
    return save_example(tmp_path_factory.mktemp("pipeline") / "tiny4.model", PIPELINE_CFG, seed=3)


def job_script(name: str):
    """``cluster/jobs/NAME`` loaded as a module (a script, not part of the package)."""
    import importlib.util
    from pathlib import Path

    jobs = Path(__file__).resolve().parents[1] / "cluster" / "jobs"
    spec = importlib.util.spec_from_file_location(f"cluster_jobs_{Path(name).stem}", jobs / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def default_signals() -> None:
    """``preexec_fn`` of a child a test stops with Ctrl-C (SIGINT) or SIGTERM: both back to their
    default disposition before the exec.  A child inherits ignored signals, and a suite started as
    a background job of a script runs with SIGINT ignored: a Python child would then never see
    its KeyboardInterrupt (Python installs its handler only where SIGINT is at the default)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def processes_of(sid: int) -> list[tuple[int, str]]:
    """Live processes whose process group or session is ``sid`` (pid, command name): what a test
    that started a process tree in a session of its own checks is gone."""
    import os
    from pathlib import Path

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp session ...
        if fields[0] != "Z" and sid in (int(fields[2]), int(fields[3])):
            found.append((int(entry), stat[stat.index("(") + 1:stat.rindex(")")]))
    return found


#: The served tests' one-line chat template (the tiny Llama has none of its own).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


def served_llama(root) -> dict:
    """What the server tests serve, in ``root``: the small random Llama (``model``), the word-level
    tokenizer of tests/fixtures/hf/llama with :data:`CHAT_TEMPLATE` (``tok``) and without a
    template (``plain``); paths as strings."""
    import json
    import shutil
    from pathlib import Path

    model = save_example(Path(root) / "tiny.model",
                         LlamaConfig(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128))
    source = Path(__file__).resolve().parent / "fixtures" / "hf" / "llama" / "tokenizer.json"
    tok, plain = Path(root) / "tok", Path(root) / "plain"
    for d in (tok, plain):
        d.mkdir()
        shutil.copy(source, d / "tokenizer.json")
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return {"model": str(model), "tok": str(tok), "plain": str(plain)}


@pytest.fixture(autouse=True)
def _compile_in_process():
    """A test that runs a command in-process (``cli.main``) enables compiling ahead for the rest
    of its worker (:mod:`dist_runtime.backends.compiled.ahead`): the tests after it would then
    run step by step while a child compiles.  Each test starts as a library caller does."""
    from dist_runtime.backends.compiled import ahead

    yield
    ahead.enable(False)

"""``--numerics``: how the compiled products multiply quantized weights.  The default (auto) takes
each weight type's faster way (the product table's ``default``: block types with Q8_0 activations,
as llama.cpp); it stays within 5e-2 of the f32 activations' logits (relative to their scale) on
the Hugging Face fixtures converted to Q8_0, with the same argmax at every position; a session's
bits are the same alone or batched in every numerics; bad names are refused naming the choices."""

from __future__ import annotations

import numpy as np
import pytest

from test_hf_import import FIXTURES, MODELS, convert_hf, reference, relative_error

from dist_runtime.backends import compiled
from dist_runtime.batched_pass import Segment
from dist_runtime.dtypes import DType
from dist_runtime.executor import GraphExecutor

pytest.importorskip("numba")

#: auto against f32 activations, relative to the logits' scale: measured at most 2.5e-2 (qwen2).
AUTO_TOLERANCE = 5e-2


@pytest.fixture(scope="module")
def q8_models(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("numerics")
    return {name: convert_hf(FIXTURES / name, out / f"{name}.model", "q8_0").out for name in MODELS}


def teacher_forced(model, numerics: str, ref: dict) -> np.ndarray:
    ex = GraphExecutor(model, numerics=numerics)
    rows = [ex.run({"tokens": ref["prompt"].astype(np.int32)})["logits"]]
    rows += [ex.run({"tokens": np.array([t], np.int32)})["logits"] for t in ref["tokens"][:-1]]
    return np.concatenate(rows)


@pytest.mark.parametrize("name", MODELS)
def test_the_default_stays_close_to_f32_activations(q8_models, name):
    ref = reference(name)
    auto, f32 = (teacher_forced(q8_models[name], n, ref) for n in ("auto", "f32"))
    assert relative_error(auto, f32) <= AUTO_TOLERANCE
    assert np.array_equal(auto.argmax(-1), f32.argmax(-1))
    assert not np.array_equal(auto, f32)  # the default did quantize the activations


def test_the_product_table_says_each_type_s_default():
    for dtype, record in compiled.PRODUCTS.items():
        assert record.default == ("f32" if dtype in (DType.F32, DType.F16, DType.BF16) else "q8_0"), dtype
        assert record.route("auto") is record.route(record.default)


@pytest.mark.parametrize("numerics", ["auto", "f32", "q8"])
def test_a_session_s_bits_are_the_same_alone_or_batched(q8_models, numerics):
    model, prompt = q8_models["llama"], reference("llama")["prompt"].astype(np.int32)
    alone = GraphExecutor(model, numerics=numerics).run({"tokens": prompt})["logits"][-1]
    batched = GraphExecutor(model, numerics=numerics)
    other = np.array([5, 9, 2], np.int32)
    rows = batched.run_batch({"tokens": np.concatenate([other, prompt])},
                             [Segment("other", 3, 0), Segment("s", len(prompt), 0)])["logits"]
    assert np.array_equal(rows[-1], alone)


def test_bad_numerics_are_refused_naming_the_choices(q8_models, capsys):
    from dist_runtime.cli import main

    with pytest.raises(ValueError, match=r"--numerics 'q4' is not one of auto, f32, q8"):
        GraphExecutor(q8_models["llama"], numerics="q4")
    with pytest.raises(ValueError, match="give backends or numerics, not both"):
        GraphExecutor(q8_models["llama"], backends=["numba"], numerics="f32")
    with pytest.raises(SystemExit) as exit_:
        main(["generate", str(q8_models["llama"]), "--ids", "1", "--numerics", "q4"])
    assert exit_.value.code == 2
    assert "invalid choice: 'q4' (choose from 'auto', 'f32', 'q8')" in capsys.readouterr().err
    assert main(["generate", str(q8_models["llama"]), "--ids", "1,2", "-n", "3", "--numerics", "q8",
                 "--show-ids"]) == 0


def test_q8_numerics_refuse_a_block_type_without_such_a_kernel(tmp_path):
    from dist_runtime.errors import GraphValidationError
    from dist_runtime.examples import LlamaConfig, llama_graph, llama_metadata, llama_weights
    from dist_runtime.model import save_model
    from dist_runtime.tensor import QuantizedArray

    cfg = LlamaConfig(vocab=64, hidden=256, layers=1, heads=4, kv_heads=2, ffn=256)
    weights = llama_weights(cfg, seed=1)
    name = "model.layers.0.mlp.up_proj.weight"
    rows, k = weights[name].shape
    weights[name] = QuantizedArray(np.zeros((rows, k // 256 * DType.Q3_K.block_bytes), np.uint8), DType.Q3_K, (rows, k))
    path = tmp_path / "q3.model"
    save_model(path, llama_graph(cfg), weights, llama_metadata(cfg)).close()
    with pytest.raises(GraphValidationError, match=r"--numerics q8: weight 'model.layers.0.mlp.up_proj.weight' is Q3_K"):
        GraphExecutor(path, numerics="q8")
    assert GraphExecutor(path, numerics="auto").run({"tokens": np.array([1, 2], np.int32)})["logits"].shape == (2, 64)

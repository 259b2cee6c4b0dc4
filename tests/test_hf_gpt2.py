"""The GPT-2 importer against transformers: fixture from tests/fixtures/make_hf_encoder_fixtures.py.

``hf/gpt2`` is a tiny random-weight ``GPT2LMHeadModel`` (tied lm_head, ``gelu_new``) written by
``save_pretrained``; ``hf/gpt2.npz`` holds a prompt, transformers' 32 greedy tokens and the logits
of one full forward pass over prompt + tokens.  The tests convert it (no torch here) and check:

* prefill logits within 1e-4 of the logits' scale; each of the 32 decode steps, one token at a time
  through the KV cache and the learned positions at the injected ``pos``, matches the row of the
  full pass; our greedy tokens are transformers' ``generate`` tokens;
* ``--dtype q8_0`` stays within a few percent; the graph is what generate and the pipeline expect.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dist_runtime.cli import main
from dist_runtime.executor import GraphExecutor
from dist_runtime.importers.hf import convert_hf_dir, load_hf_dir
from dist_runtime.importers.hf.common import HFImportError
from dist_runtime.importers.hf.gpt2 import gpt2_config, load
from dist_runtime.ir.graph import POS
from dist_runtime.ir.ops import Gelu, KvCache, LayerNorm, PosEmbed, Sdpa, Split
from dist_runtime.model import load_model
from test_hf_import import greedy_run, relative_error

pytest.importorskip("safetensors")

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "hf" / "gpt2"
TOLERANCE = 1e-4  # of the logits' scale (max |logit| of the reference)


def reference() -> dict[str, np.ndarray]:
    with np.load(FIXTURE.with_suffix(".npz")) as f:
        return dict(f)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return convert_hf_dir(FIXTURE, tmp_path_factory.mktemp("gpt2") / "gpt2.model").out


def test_prefill_and_greedy_decode_match_transformers(converted):
    ref = reference()
    prompt, tokens, logits = ref["prompt"], ref["tokens"], ref["logits"]
    p = len(prompt)
    ours, picks = greedy_run(converted, prompt, len(tokens))
    assert ours.shape == logits.shape and ours.dtype == np.float32
    assert relative_error(ours[:p], logits[:p]) <= TOLERANCE, "prefill"
    for step in range(len(tokens)):
        assert relative_error(ours[p + step], logits[p + step]) <= TOLERANCE, f"decode step {step}"
    assert picks == tokens.tolist()


def test_graph_is_what_generate_and_the_pipeline_expect(converted):
    with load_model(converted, tensors=[]) as model:
        graph, index, meta = model.graph, model.index, model.metadata
    ops = [n.op for n in graph.nodes]
    assert graph.input_names == ["tokens"] and graph.outputs == ["logits"]
    assert [s.shape for s in graph.inputs] == [(-1,)]
    assert meta["architecture"] == "gpt2" and meta["config"]["context_length"] == 64 and meta["eos_token_id"] == 2
    assert meta["config"]["vocab"] == 128
    pos_embed = next(n for n in graph.nodes if isinstance(n.op, PosEmbed))
    assert pos_embed.inputs == ["h_embed", "wpe.weight", POS]  # positions follow the KV cache
    assert sum(isinstance(o, KvCache) for o in ops) == 2 and all(o.causal for o in ops if isinstance(o, Sdpa))
    assert {o.sizes for o in ops if isinstance(o, Split)} == {(64, 64, 64)}
    assert all(o.approximate for o in ops if isinstance(o, Gelu)) and sum(isinstance(o, LayerNorm) for o in ops) == 5
    # Conv1D [in, out] became [out, in]; tied: the logits read wte, stored once
    assert index["h.0.attn.c_attn.weight"].shape == (192, 64) and index["h.0.mlp.c_proj.weight"].shape == (64, 256)
    assert graph.nodes[-1].inputs == ["final_norm", "wte.weight"] and "lm_head.weight" not in index


def test_conv1d_weights_are_transposed():
    from safetensors import safe_open

    imported = load(FIXTURE)
    with safe_open(str(FIXTURE / "model.safetensors"), framework="numpy") as f:
        stored = f.get_tensor("transformer.h.1.mlp.c_fc.weight")
    assert np.array_equal(imported.weights["h.1.mlp.c_fc.weight"], stored.T)
    assert imported.weights["h.1.mlp.c_fc.weight"].flags.c_contiguous


def test_q8_0_stays_close(tmp_path):
    """Measured: 1.4e-2 of the logits' scale with teacher forcing."""
    report = convert_hf_dir(FIXTURE, tmp_path / "q.model", "q8_0")
    stored = report.stored
    assert stored["h.0.attn.c_attn.weight"] == "q8_0" and stored["wte.weight"] == "q8_0"
    assert stored["wpe.weight"] == stored["h.0.ln_1.weight"] == stored["h.0.attn.c_attn.bias"] == "f32"
    ref = reference()
    ours, _ = greedy_run(report.out, ref["prompt"], len(ref["tokens"]), feed=ref["tokens"])
    assert relative_error(ours, ref["logits"]) < 5e-2


def test_generate_cli_runs_it(converted, capsys):
    ref = reference()
    prompt = ",".join(str(t) for t in ref["prompt"])
    assert main(["generate", str(converted), "--ids", prompt, "-n", "8", "--ignore-eos", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sessions"][0]["ids"] == ref["tokens"][:8].tolist()
    assert main(["generate", str(converted), "--ids", prompt, "-n", "60"]) == 1
    assert "exceed the context length 64" in capsys.readouterr().err


# -- checkpoint layouts ----------------------------------------------------------------------------
def rewrite(tmp_path: Path, rename, extra: dict | None = None, config: dict | None = None) -> Path:
    from safetensors.numpy import load_file, save_file

    d = Path(shutil.copytree(FIXTURE, tmp_path / "gpt2"))
    tensors = {rename(k): v for k, v in load_file(str(d / "model.safetensors")).items()}
    save_file(tensors | (extra or {}), str(d / "model.safetensors"))
    if config:
        (d / "config.json").write_text(json.dumps(json.loads((d / "config.json").read_text()) | config))
    return d


def prefill(model_dir: Path):
    imported = load_hf_dir(model_dir)
    logits = GraphExecutor((imported.graph, imported.weights), kv_dtype="f32").run({"tokens": reference()["prompt"].astype(np.int32)})
    return imported, logits["logits"]


def test_unprefixed_checkpoint_with_mask_buffers(tmp_path):
    """The original ``gpt2`` hub checkpoint: no ``transformer.`` prefix, causal-mask buffers."""
    d = rewrite(tmp_path, lambda k: k.removeprefix("transformer."),
                {"h.0.attn.bias": np.tril(np.ones((1, 1, 64, 64), np.float32))})
    imported, logits = prefill(d)
    assert imported.ignored == ["h.0.attn.bias"]
    assert relative_error(logits, reference()["logits"][:8]) <= TOLERANCE


def test_untied_lm_head(tmp_path):
    from safetensors.numpy import load_file

    wte = load_file(str(FIXTURE / "model.safetensors"))["transformer.wte.weight"]
    d = rewrite(tmp_path, lambda k: k, {"lm_head.weight": 2 * wte}, {"tie_word_embeddings": False})
    imported, logits = prefill(d)
    assert imported.graph.nodes[-1].inputs == ["final_norm", "lm_head.weight"]
    assert relative_error(logits, 2 * reference()["logits"][:8]) <= TOLERANCE
    (d / "model.safetensors").write_bytes((FIXTURE / "model.safetensors").read_bytes())
    with pytest.raises(HFImportError, match=r"lacks 1 tensor\(s\) a GPT2LMHeadModel .*: lm_head.weight \[128, 64\]"):
        load(d)


def test_wrong_shape_names_the_stored_layout(tmp_path):
    d = rewrite(tmp_path, lambda k: k, config={"n_inner": 128})
    with pytest.raises(HFImportError, match=r"transformer.h.0.mlp.c_fc.weight: \[64, 256\], expected \[64, 128\]"):
        load(d)


# -- config errors ---------------------------------------------------------------------------------
def base_config(**changes) -> dict:
    return json.loads((FIXTURE / "config.json").read_text()) | changes


@pytest.mark.parametrize("changes, match", [
    ({"activation_function": "relu"}, r"activation_function='relu' is not supported; supported: \['gelu'"),
    ({"scale_attn_by_inverse_layer_idx": True}, r"scale_attn_by_inverse_layer_idx=True is not supported"),
    ({"scale_attn_weights": False}, r"scale_attn_weights=False is not supported"),
    ({"add_cross_attention": True}, r"add_cross_attention=True is not supported"),
    ({"n_embd": None}, r"config.json lacks 'n_embd'"),
    ({"n_head": 5}, r"n_embd 64 is not a multiple of n_head 5"),
    ({"model_type": "bert"}, r"model_type 'bert' is not GPT-2"),
])
def test_config_errors(changes, match):
    with pytest.raises(HFImportError, match=match):
        gpt2_config(base_config(**changes))


def test_config_variants():
    cfg = gpt2_config(base_config(activation_function="gelu", n_inner=96, layer_norm_epsilon=1e-6))
    assert (cfg.gelu_tanh, cfg.ffn, cfg.eps, cfg.tied) == (False, 96, 1e-6, True)
    assert gpt2_config(base_config(tie_word_embeddings=False)).tied is False


def test_pipeline_stages_give_the_executors_logits(converted):
    """Cut in 2 and 3 stages (the tied ``wte`` is read by the first and the last) and run in
    process as the pipeline's stage workers do: the single-process executor's logits."""
    from dist_runtime.pipeline.launch import make_plan
    from dist_runtime.pipeline.stage import StageWorker
    from dist_runtime.pipeline.subgraph import stages_for_plan
    from dist_runtime.transport import decode_message, encode_message

    with load_model(converted) as model:
        ref = GraphExecutor(model, fuse=False)
        prompt = reference()["prompt"].tolist()
        for n in (2, 3):
            stages = stages_for_plan(model.graph, make_plan(model.graph, stages=n, max_context=64))
            workers = [StageWorker(st, fuse=False) for st in stages]
            assert all(w.load_file(str(converted))["loaded"] for w in workers)
            for tokens, pos in ((prompt, 0), ([9], len(prompt)), ([2, 6], len(prompt) + 1)):
                want = ref.run({"tokens": np.array(tokens, np.int32)}, session=n, pos=pos)["logits"]
                message = encode_message({"tokens": np.asarray(tokens, np.int32)},
                                         {"session": "s", "pos": pos, "step": 1, "logits": "all"})
                for w in workers:
                    message = w.step(message)
                np.testing.assert_allclose(decode_message(message)[0]["logits"], want, rtol=0, atol=1e-5)

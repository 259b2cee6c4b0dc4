"""The Hugging Face importer against transformers: fixtures from tests/fixtures/make_hf_fixtures.py.

Each fixture is a tiny random-weight checkpoint written by transformers' ``save_pretrained``
(Llama with grouped-query attention; Qwen2 with attention biases, tied embeddings and a sharded
checkpoint; Phi with partial rotary, parallel attention/MLP and LayerNorm, stored in f16; Mistral
with a sliding window of 8, stored in bf16) and the logits transformers computed for it.  The tests
convert the checkpoint (no torch here), then check:

* prefill: our logits over the prompt match transformers' within 1e-4 of the logits' scale (an F32
  KV cache; the default F16 one within 2e-3);
* decode: each step of a 32-token greedy run, one token at a time through the KV cache, matches
  the row of transformers' single full forward pass over the same tokens, and our greedy tokens are
  transformers' ``generate`` tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dist_runtime.cli import main
from dist_runtime.dtypes import DType
from dist_runtime.errors import DistRuntimeError
from dist_runtime.examples import LlamaConfig, llama_graph
from dist_runtime.executor import GraphExecutor
from dist_runtime.importers.common import tokenizer_path_for
from dist_runtime.importers.hf.common import HFImportError
from dist_runtime.importers.hf.llama import convert_hf, decoder_config, decoder_graph, load_hf
from dist_runtime.ir.ops import Gelu, LayerNorm, Rope, Sdpa, SdpaWindow
from dist_runtime.model import load_model

pytest.importorskip("safetensors")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
MODELS = ("llama", "qwen2", "phi", "mistral")
TOLERANCE = 1e-4  # of the logits' scale (max |logit| of the reference)
#: An F16 KV cache (the default) rounds K and V to 11 significant bits: at most 6.7e-4 of the logits'
#: scale on these fixtures (qwen2), the same greedy tokens.
F16_TOLERANCE = 2e-3


def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"{name}.npz") as f:
        return dict(f)


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("hf")
    return {name: convert_hf(FIXTURES / name, out / f"{name}.model").out for name in MODELS}


def greedy_run(model, prompt: np.ndarray, steps: int, feed: np.ndarray | None = None, kv_dtype: str = "f32",
               numerics: str = "f32"):
    """Prefill then ``steps`` single-token runs; the token fed at each step is our own greedy pick,
    or ``feed[i]`` (teacher forcing).  Returns (logits [P + steps, V], our greedy picks)."""
    ex = GraphExecutor(model, kv_dtype=kv_dtype, numerics=numerics)
    rows = [ex.run({"tokens": prompt.astype(np.int32)})["logits"]]
    picks = []
    for i in range(steps):
        picks.append(int(rows[-1][-1].argmax()))
        token = picks[-1] if feed is None else int(feed[i])
        rows.append(ex.run({"tokens": np.array([token], np.int32)})["logits"])
    return np.concatenate(rows), picks


# -- agreement with transformers -------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype, tolerance", [("f32", TOLERANCE), ("f16", F16_TOLERANCE)])
@pytest.mark.parametrize("name", MODELS)
def test_prefill_and_greedy_decode_match_transformers(name, kv_dtype, tolerance, converted):
    ref = reference(name)
    prompt, tokens, logits = ref["prompt"], ref["tokens"], ref["logits"]
    p = len(prompt)
    ours, picks = greedy_run(converted[name], prompt, len(tokens), kv_dtype=kv_dtype)
    assert ours.shape == logits.shape and ours.dtype == np.float32
    assert relative_error(ours[:p], logits[:p]) <= tolerance, "prefill"
    for step in range(len(tokens)):  # row p + step: after feeding generated token `step`
        assert relative_error(ours[p + step], logits[p + step]) <= tolerance, f"decode step {step}"
    assert picks == tokens.tolist()


def test_fixtures_cover_what_they_claim():
    """The properties the tests above rely on hold in the stored fixtures."""
    qwen2 = json.loads((FIXTURES / "qwen2" / "config.json").read_text())
    assert qwen2["tie_word_embeddings"] and (FIXTURES / "qwen2" / "model.safetensors.index.json").is_file()
    assert len(list((FIXTURES / "qwen2").glob("*.safetensors"))) > 1
    assert json.loads((FIXTURES / "phi" / "config.json").read_text())["dtype"] == "float16"
    mistral = json.loads((FIXTURES / "mistral" / "config.json").read_text())
    assert mistral["sliding_window"] < len(reference("mistral")["logits"]) and mistral["dtype"] == "bfloat16"
    llama = json.loads((FIXTURES / "llama" / "config.json").read_text())
    assert llama["num_key_value_heads"] < llama["num_attention_heads"]
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert total < 3 * 2**20


def test_graphs_have_each_architectures_features(converted):
    def ops(name):
        model = load_model(converted[name], tensors=[])
        graph, index = model.graph, model.index
        model.close()
        return graph, index, [n.op for n in graph.nodes]

    graph, index, op = ops("llama")
    assert {(o.num_heads, o.kv_heads) for o in op if isinstance(o, Sdpa)} == {(4, 2)}
    assert graph.outputs == ["logits"] and "lm_head.weight" in index
    graph, index, op = ops("qwen2")
    assert "lm_head.weight" not in index  # tied: the embedding table, stored once
    assert graph.nodes[-1].inputs == ["final_norm", "model.embed_tokens.weight"]
    assert all(f"model.layers.0.self_attn.{x}_proj.bias" in index for x in "qkv")
    assert {o.base for o in op if isinstance(o, Rope)} == {1e6}
    graph, index, op = ops("phi")
    assert {(o.head_dim, o.rope_dim) for o in op if isinstance(o, Rope)} == {(16, 8)}
    assert sum(isinstance(o, LayerNorm) for o in op) == 3  # one per layer (parallel block) + final
    assert all(o.approximate for o in op if isinstance(o, Gelu)) and "lm_head.bias" in index
    graph, index, op = ops("mistral")
    assert {o.window for o in op if isinstance(o, SdpaWindow)} == {8}
    assert not any(type(o) is Sdpa for o in op)


# -- --dtype ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("numerics, tolerance", [("f32", 5e-2), ("auto", 7.5e-2)])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_q8_0_stays_close(name, numerics, tolerance, tmp_path):
    """Matmul weights (and the embedding table) in Q8_0, norms and biases in f32; logits within a
    few percent of transformers' with teacher forcing (measured: llama 1.3e-2, qwen2 3.4e-2 with
    f32 activations; 1.8e-2 and 5.0e-2 with the default's Q8_0 ones)."""
    report = convert_hf(FIXTURES / name, tmp_path / "q.model", "q8_0")
    with load_model(report.out, tensors=[]) as model:
        dtypes = {n: s.dtype for n, s in model.index.items()}
    assert all(dtypes[n] == (DType.Q8_0 if n.endswith("weight") and len(s.shape) == 2 else DType.F32)
               for n, s in model.index.items())
    assert sorted(n for n, d in report.stored.items() if d == "f32") == sorted(n for n, d in dtypes.items() if d == DType.F32)
    assert report.dtypes == {"q8_0": sum(d == DType.Q8_0 for d in dtypes.values()), "f32": sum(d == DType.F32 for d in dtypes.values())}
    ref = reference(name)
    ours, _ = greedy_run(report.out, ref["prompt"], len(ref["tokens"]), feed=ref["tokens"], numerics=numerics)
    assert relative_error(ours, ref["logits"]) < tolerance


def test_other_dtypes(tmp_path):
    ref = reference("llama")
    errors = {}
    for dtype in ("f16", "bf16", "q4_0"):
        report = convert_hf(FIXTURES / "llama", tmp_path / f"{dtype}.model", dtype)
        stored = report.stored
        assert stored["model.layers.0.mlp.down_proj.weight"] == dtype
        # a half-precision table would make every activation half precision: it stays f32
        assert stored["model.embed_tokens.weight"] == (dtype if dtype == "q4_0" else "f32")
        assert stored["model.norm.weight"] == "f32"
        ours, _ = greedy_run(report.out, ref["prompt"], 8, feed=ref["tokens"])
        errors[dtype] = relative_error(ours, ref["logits"][:len(ours)])
    assert errors["f16"] < 2e-3 and errors["bf16"] < 2e-2
    assert errors["f16"] < errors["bf16"] < errors["q4_0"] < 0.5


def test_bf16_checkpoint_round_trips_exactly_to_bf16(tmp_path):
    """Mistral is stored in bf16: --dtype bf16 keeps its matmul weights bit for bit."""
    imported = load_hf(FIXTURES / "mistral", "bf16")
    from safetensors import safe_open

    with safe_open(str(FIXTURES / "mistral" / "model.safetensors"), framework="numpy") as f:
        stored = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
    assert np.array_equal(imported.weights["model.layers.1.self_attn.q_proj.weight"].view(np.uint16),
                          stored.view(np.uint16))


# -- the graph builder is the examples' ------------------------------------------------------------
def test_example_llama_is_the_imported_llama_graph():
    cfg = LlamaConfig(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=96, rope_base=5e5, eps=1e-6)
    hf = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
          "rope_theta": 5e5, "rms_norm_eps": 1e-6}
    imported = decoder_graph(decoder_config(hf))
    example = llama_graph(cfg)
    assert [(n.op, n.inputs, n.outputs) for n in example.nodes[:-1]] == \
           [(n.op, n.inputs, n.outputs) for n in imported.nodes]
    assert example.outputs == ["logits", "next_token"] and imported.outputs == ["logits"]


# -- config variants -------------------------------------------------------------------------------
def base_config(**changes) -> dict:
    return json.loads((FIXTURES / "llama" / "config.json").read_text()) | changes


@pytest.mark.parametrize("changes, match", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
     r"unsupported architecture 'gpt2' / 'GPT2LMHeadModel'; supported: LlamaForCausalLM .*MistralForCausalLM"
     r".*Qwen2ForCausalLM .*PhiForCausalLM"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"rope_scaling 'llama3' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling 'linear' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     r"rope_parameters 'yarn' is not supported"),
    ({"hidden_size": None}, r"config.json lacks 'hidden_size'"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ({"num_key_value_heads": 3}, r"not a multiple of num_key_value_heads 3"),
    ({"quantization_config": {"quant_method": "gptq"}}, r"pre-quantized checkpoints \(gptq\)"),
])
def test_config_errors(changes, match):
    with pytest.raises(HFImportError, match=match):
        decoder_config(base_config(**changes))


def test_config_variants():
    # transformers 4's flat rope keys and null rope_scaling
    old = base_config(rope_parameters=None, rope_theta=5e5, rope_scaling=None)
    assert decoder_config(old).rope_base == 5e5
    assert decoder_config(base_config(rope_scaling={"rope_type": "default"})).rope_base == 1e4
    # Llama's optional biases; an explicit head_dim
    cfg = decoder_config(base_config(attention_bias=True, mlp_bias=True, head_dim=32))
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.head_dim) == (True, True, True, 32)
    # Qwen2's sliding layers, transformers 4 style: from max_window_layers on
    qwen = base_config(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    qwen.pop("layer_types", None)
    assert decoder_config(qwen).windows == (0, 16)
    # a window as long as the context never excludes a key: plain attention
    assert decoder_config(base_config(model_type="mistral", sliding_window=256)).windows == ()


# -- checkpoint errors -----------------------------------------------------------------------------
def copy_fixture(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def test_missing_config(tmp_path):
    with pytest.raises(HFImportError, match="has no config.json"):
        load_hf(tmp_path)
    with pytest.raises(HFImportError, match="is not a directory"):
        load_hf(tmp_path / "nowhere")


def test_missing_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = copy_fixture("llama", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(HFImportError, match=r"lacks 1 tensor\(s\).*model.layers.1.mlp.up_proj.weight \[128, 64\]"):
        load_hf(d)


def test_wrong_shape_and_missing_weights(tmp_path):
    d = copy_fixture("llama", tmp_path)
    (d / "config.json").write_text(json.dumps(base_config(intermediate_size=96)))
    with pytest.raises(HFImportError, match=r"mlp.gate_proj.weight: \[128, 64\], expected \[96, 64\]"):
        load_hf(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(HFImportError, match=r"has no \*.safetensors weights"):
        load_hf(d)


def test_missing_shard(tmp_path):
    d = copy_fixture("qwen2", tmp_path)
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(HFImportError, match=r"lists shards that are missing: \['model-00002-of-00003"):
        load_hf(d)


def test_bad_dtype_is_refused():
    with pytest.raises(HFImportError, match=r"--dtype 'q5_1' is not one of f32, f16, bf16, q8_0, q4_0"):
        load_hf(FIXTURES / "llama", "q5_1")


# -- the convert command ---------------------------------------------------------------------------
def test_convert_cli(tmp_path, capsys):
    out = tmp_path / "m" / "llama.model"
    assert main(["convert", str(FIXTURES / "llama"), "-o", str(out), "--dtype", "q8_0", "-q"]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out}: huggingface llama, 21 tensors" in text
    assert "  dtypes: 16 q8_0, 5 f32\n" in text
    assert ("kept as stored or f32 (not a matmul weight, or no whole blocks): model.layers.*.input_layernorm.weight (x2), "
            "model.layers.*.post_attention_layernorm.weight (x2), model.norm.weight\n") in text
    assert "  ops (35 nodes): Matmul 15, RmsNorm 5, Rope 4, Add 4, KvCache 2, Sdpa 2, SwiGlu 2, TokenEmbed 1\n" in text
    tok = tokenizer_path_for(out)
    assert tok.name == "llama.tokenizer.json" and tok.read_bytes() == (FIXTURES / "llama" / "tokenizer.json").read_bytes()
    with load_model(out, tensors=[]) as model:
        meta = model.metadata
    assert (meta["architecture"], meta["dtype"], meta["tokenizer"], meta["eos_token_id"]) == ("llama", "q8_0", tok.name, 2)
    assert meta["source"]["dtypes"] == {"F32": 21}
    assert main(["validate", str(out)]) == 0


def test_convert_cli_json_and_errors(tmp_path, capsys):
    out = tmp_path / "phi.model"
    assert main(["convert", str(FIXTURES / "phi"), "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["architecture"] == "phi" and report["tokenizer"] is None and report["dtypes"] == {"f32": report["tensors"]}
    assert issubclass(HFImportError, DistRuntimeError)  # so the CLI reports it and exits 1
    assert main(["convert", str(tmp_path), "-o", str(tmp_path / "x.model")]) == 1
    assert "is a directory without config.json" in capsys.readouterr().err
    assert not (tmp_path / "x.model").exists()


def test_progress_without_tqdm(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    convert_hf(FIXTURES / "mistral", tmp_path / "m.model", progress=True)
    err = capsys.readouterr().err
    assert "converting [" in err and err.endswith("] 21/21\n")


def test_convert_detects_the_format_and_names_what_it_cannot_read(tmp_path, capsys):
    """``convert`` dispatches on what the source is; anything else is named, and nothing is written."""
    from dist_runtime.importers import convert, detect_format

    assert detect_format(FIXTURES / "llama") == "huggingface"
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(HFImportError, match=r"model_type 't5' is not supported; supported: bert, gpt2, "
                                            r"llama, mistral, phi, qwen2"):
        convert(t5, tmp_path / "t5.model")
    fake = tmp_path / "weights.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(DistRuntimeError, match=r"ends in .gguf but does not start with the GGUF magic"):
        detect_format(fake)
    other = tmp_path / "model.bin"
    other.write_bytes(b"\x00" * 16)
    assert main(["convert", str(other), "-o", str(tmp_path / "x.model")]) == 1
    assert "cannot tell the format of" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin", "t5", "weights.gguf"]

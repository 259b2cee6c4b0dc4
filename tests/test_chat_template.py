"""Chat templates travel with the model: ``convert`` stores a Hugging Face directory's
(chat_template.jinja, tokenizer_config.json's string or named "default") or a GGUF file's
``tokenizer.chat_template`` in the metadata; ``serve`` uses it with no flag, ``--chat-template``
overrides it; ``inspect`` shows it; malformed ones are refused naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dist_runtime.cli import main
from dist_runtime.importers.hf.common import HFImportError
from dist_runtime.importers.hf.llama import convert_hf
from dist_runtime.model import load_model
from dist_runtime.serve.served_model import ServedModel
from dist_runtime.serve.text import render_chat

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "llama"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def hf_dir(tmp_path: Path, **files) -> Path:
    d = tmp_path / "hf"
    shutil.copytree(FIXTURE, d)
    for name, content in files.items():
        (d / name.replace("__", ".")).write_text(content if isinstance(content, str) else json.dumps(content))
    return d


def converted(tmp_path: Path, **files) -> Path:
    out = tmp_path / "m.model"
    convert_hf(hf_dir(tmp_path, **files), out)
    return out


@pytest.mark.parametrize("files", [
    {"tokenizer_config__json": {"chat_template": TEMPLATE, "model_max_length": 256}},
    {"tokenizer_config__json": {"chat_template": [{"name": "tool_use", "template": "x"},
                                                  {"name": "default", "template": TEMPLATE}]}},
    {"chat_template__jinja": TEMPLATE, "tokenizer_config__json": {"chat_template": "older"}},
], ids=["string", "named-default", "jinja-file-first"])
def test_convert_stores_the_directory_s_template_and_serve_uses_it(tmp_path, files):
    out = converted(tmp_path, **files)
    with load_model(out, tensors=[]) as model:
        assert model.metadata["chat_template"] == TEMPLATE
    (tmp_path / "hf").rename(tmp_path / "gone")  # nothing beside the source is needed any more
    served = ServedModel.open(out)
    assert served.chat_template == TEMPLATE
    text = render_chat(served.chat_template, [{"role": "user", "content": "hi"}], served.special_tokens())
    assert text.startswith("<|user|>hi") and text.endswith("<|assistant|>")
    override = tmp_path / "other.jinja"
    override.write_text("{{ messages[0]['content'] }}")
    assert ServedModel.open(out, chat_template=override).chat_template == "{{ messages[0]['content'] }}"


def test_generation_config_s_end_of_sequence_ids_are_stored(tmp_path):
    out = converted(tmp_path, generation_config__json={"eos_token_id": [2, 7], "bos_token_id": 1})
    with load_model(out, tensors=[]) as model:
        assert model.metadata["eos_token_id"] == [2, 7] and "chat_template" not in model.metadata
    assert ServedModel.open(out).stop == frozenset({2, 7})


@pytest.mark.parametrize("files, says", [
    ({"tokenizer_config__json": "{not json"}, "tokenizer_config.json is not JSON"),
    ({"tokenizer_config__json": [1, 2]}, "tokenizer_config.json is not a JSON object"),
    ({"tokenizer_config__json": {"chat_template": 5}}, "the chat template is a int, not a string"),
    ({"chat_template__jinja": "x" * (2**20 + 1)}, "larger than 1048576 bytes"),
])
def test_a_malformed_template_is_refused_naming_the_file(tmp_path, files, says):
    with pytest.raises(HFImportError, match=says) as err:
        converted(tmp_path, **files)
    assert str(tmp_path / "hf") in str(err.value)
    assert not (tmp_path / "m.model").exists()


def test_a_gguf_file_s_template_is_stored(tmp_path):
    pytest.importorskip("gguf")
    from test_gguf_import import write_gguf

    from dist_runtime.importers.gguf_file import GGUFImportError, load

    path = write_gguf(tmp_path / "t.gguf", meta={"tokenizer.chat_template": TEMPLATE})
    assert load(path).metadata["chat_template"] == TEMPLATE
    assert "chat_template" not in load(write_gguf(tmp_path / "none.gguf")).metadata
    bad = write_gguf(tmp_path / "bad.gguf", meta={"tokenizer.chat_template": 5})
    with pytest.raises(GGUFImportError, match="tokenizer.chat_template = 5 is not a string"):
        load(bad)


def test_inspect_shows_the_template_s_size_and_start_not_all_of_it(tmp_path, capsys):
    out = converted(tmp_path, tokenizer_config__json={"chat_template": TEMPLATE + " " * 500})
    assert main(["inspect", str(out)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "chat_template" in ln)
    assert f"{len(TEMPLATE) + 500} characters, used by serve for chat: " in line and len(line) < 200
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metadata"]["chat_template"] == TEMPLATE + " " * 500


def test_a_model_file_with_a_template_of_another_type_is_refused(tmp_path):
    from dist_runtime.model import save_model

    with pytest.raises(ValueError, match="metadata key 'chat_template' must be a str"):
        with load_model(converted(tmp_path), tensors=[]) as model:
            save_model(tmp_path / "x.model", model.graph, {}, {"chat_template": 3})

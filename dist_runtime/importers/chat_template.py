"""Chat templates as models carry them: a Hugging Face directory's ``chat_template.jinja`` or
``tokenizer_config.json``'s ``chat_template`` (a string, or a named list whose "default" entry is
the chat one), a GGUF file's ``tokenizer.chat_template``.  ``convert`` stores the template in the
``.model``'s metadata (``chat_template``), where ``serve`` finds it; ``serve --chat-template``
reads a file with :func:`read_template` too."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import DistRuntimeError

#: Files holding a chat template in a Hugging Face directory, in the order transformers prefers them.
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")
#: A template longer than this is refused (real ones are a few KiB; it is stored in the metadata).
MAX_TEMPLATE_BYTES = 1 << 20


def read_template(path: Path) -> str | None:
    """The chat template in ``path``: a template file (``.jinja``, or any other suffix but .json),
    or a tokenizer_config.json (None when it has no chat template)."""
    try:
        if path.stat().st_size > MAX_TEMPLATE_BYTES * 8:  # a tokenizer_config.json holds more than it
            raise DistRuntimeError(f"{path} is {path.stat().st_size} bytes: too large for a chat template file")
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise DistRuntimeError(f"cannot read chat template {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise DistRuntimeError(f"{path} is not UTF-8 text") from None
    template = text if path.suffix != ".json" else _from_tokenizer_config(path, text)
    return checked(template, str(path))


def template_in(directory: Path, prefix: str = "") -> str | None:
    """The chat template of the files beside a tokenizer (``prefix``: their ``NAME.`` prefix as
    ``convert`` copies a tokenizer), or None."""
    for name in TEMPLATE_FILES:
        for candidate in dict.fromkeys((directory / (prefix + name), directory / name)):
            if candidate.is_file() and (template := read_template(candidate)) is not None:
                return template
    return None


def checked(template, where: str) -> str | None:
    """``template`` if it is a usable template string; None for none; an error naming ``where``."""
    if template is None:
        return None
    if not isinstance(template, str):
        raise DistRuntimeError(f"{where}: the chat template is a {type(template).__name__}, not a string")
    if len(template.encode("utf-8")) > MAX_TEMPLATE_BYTES:
        raise DistRuntimeError(f"{where}: the chat template is larger than {MAX_TEMPLATE_BYTES} bytes")
    return template if template.strip() else None


def _from_tokenizer_config(path: Path, text: str):
    try:
        config = json.loads(text)
    except ValueError:
        raise DistRuntimeError(f"{path} is not JSON (a tokenizer_config.json)") from None
    if not isinstance(config, dict):
        raise DistRuntimeError(f"{path} is not a JSON object (a tokenizer_config.json)")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers' chat one is "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template

"""Text in and out of the server: chat messages rendered with the model's chat template (as
Hugging Face's ``apply_chat_template`` renders them), and generated tokens turned into text that
never shows a stop string, even one split across tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from ..errors import DistRuntimeError
from ..importers.chat_template import checked, read_template, template_in

def find_chat_template(tokenizer: Path | None, override: str | Path | None = None,
                       metadata: dict | None = None) -> str | None:
    """The chat template: ``override`` (a .jinja file or a tokenizer_config.json), else the one
    ``convert`` stored in the model's ``metadata``, else one in a file beside ``tokenizer`` (a
    model converted without it); None when there is none (chat is then refused)."""
    if override is not None:
        return read_template(Path(override))
    if metadata and metadata.get("chat_template"):
        return checked(metadata["chat_template"], "the model's metadata")
    if tokenizer is None:
        return None
    prefix = tokenizer.name[:-len("tokenizer.json")] if tokenizer.name.endswith("tokenizer.json") else ""
    return template_in(tokenizer.parent, prefix)


def render_chat(template: str, messages: Sequence[dict], special_tokens: dict, tools: list | None = None) -> str:
    """``messages`` rendered as transformers' ``apply_chat_template(add_generation_prompt=True)``
    does: a sandboxed jinja2 environment with its options, ``raise_exception`` and ``tojson``;
    ``tools`` given to the template as ``tools`` (templates that support tools describe them)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=list(messages), add_generation_prompt=True,
                                                **special_tokens, **({"tools": tools} if tools else {}))
    except TemplateError as e:
        raise DistRuntimeError(f"the chat template refused the messages: {e}") from None


class StopText:
    """Text pieces in, text out, cut before the first stop string.  Text that could be the start
    of a stop string is held back until the next piece says whether it is."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def add(self, text: str) -> tuple[str, bool]:
        """(text that can be shown, whether a stop string ended the generation)."""
        text = self.held + text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return text[:min(hits)], True
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(text) + 1))
                    if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """What was held back, once no more text comes."""
        text, self.held = self.held, ""
        return text


class TokenText:
    """The text of one generation as its tokens arrive: the tokenizer's (decoded as a whole, so
    spacing and multi-byte characters come out right), or the ids themselves when the model has
    no tokenizer, space-separated as ``dist-runtime generate`` prints them."""

    def __init__(self, tokenizer) -> None:
        from ..importers.tokenizer import StreamDecoder

        self.decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
        self.count = 0

    def add(self, token: int) -> str:
        self.count += 1
        if self.decoder is not None:
            return self.decoder.add(token)
        return ("" if self.count == 1 else " ") + str(token)

    def finish(self) -> str:
        return self.decoder.finish() if self.decoder is not None else ""

"""Tool calls (``tools``, ``tool_choice``) for chat: which grammar a choice is held to, and the
calls read back from its text.

``required`` and a named function hold the choice to a JSON array of calls,
``[{"name": ..., "arguments": {...}}]``, each call's arguments to its function's ``parameters``
schema (constrained sampling, :mod:`dist_runtime.grammar`).  ``auto`` lets the model choose: its
text is read as calls when it is one of the shapes models are taught (that JSON array or one such
object, ``"parameters"`` for ``"arguments"`` as Llama's templates write it, or Hermes/Qwen's
``<tool_call>...</tool_call>`` blocks), and is the answer's content otherwise.  ``none``: no call.
"""

from __future__ import annotations

import json
import re
import uuid

from ..errors import DistRuntimeError

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def mode_of(tools: list | None, choice) -> str | None:
    """None (no tools, or ``none``), ``"auto"``, ``"required"`` or a function's name; a
    DistRuntimeError naming what is wrong with ``tool_choice``."""
    if choice is not None and not tools and choice != "none":
        raise DistRuntimeError("tool_choice needs tools")
    if not tools or choice == "none":
        return None
    if choice is None or choice in ("auto", "required"):
        return choice or "auto"
    name = choice.function.name
    if name not in {t.function.name for t in tools}:
        raise DistRuntimeError(f"tool_choice names {name!r}, which is not among the tools "
                               f"({', '.join(t.function.name for t in tools)})")
    return name


def calls_schema(tools: list, mode: str, parallel: bool | None = None) -> dict:
    """The JSON schema of what a choice in ``mode`` (``required`` or a name) may write: one call,
    or with ``parallel`` (``parallel_tool_calls``, OpenAI's default) one or more."""
    chosen = [t for t in tools if mode == "required" or t.function.name == mode]
    one = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                             "arguments": t.function.parameters or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    return {"type": "array", "items": one[0] if len(one) == 1 else {"anyOf": one}, "minItems": 1,
            **({} if parallel is None or parallel else {"maxItems": 1})}


def parse_calls(text: str, tools: list) -> list[dict] | None:
    """The tool calls ``text`` holds, in OpenAI's shape; None when it is not calls."""
    names = {t.function.name for t in tools}
    blocks = _BLOCK.findall(text)
    items = []
    for piece in blocks or [text]:
        try:
            value = json.loads(piece)
        except ValueError:
            return None
        items += value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": item["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
    return calls or None


def template_tools(tools: list) -> list[dict]:
    """The tools as chat templates take them (transformers' ``apply_chat_template(tools=...)``)."""
    return [t.model_dump(exclude_none=True, by_alias=True) for t in tools]

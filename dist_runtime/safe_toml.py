"""Parsing TOML from untrusted bytes: size, encoding, nesting and key depth checked, every failure
a ``ModelFormatError``.

``tomllib`` alone is not safe on hostile input: it raises ``RecursionError`` on deep nesting, a
bare ``ValueError`` on huge integers, and takes time quadratic in the parts of one dotted key (a
40,000-part ``a.a.a…=1`` took 40 s here).  Both the ``.model`` container and the TOML graph form
parse through :func:`parse_toml`.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

from .errors import ModelFormatError

#: A TOML section larger than this is refused before parsing.
MAX_TOML_BYTES = 64 * 2**20
#: Deepest table/array nesting, and most parts in one dotted key, that a document may have.
MAX_TOML_DEPTH = 64

_STRINGS_AND_COMMENTS = re.compile(
    r'"""[\s\S]*?(?:"""|\Z)|\'\'\'[\s\S]*?(?:\'\'\'|\Z)|"(?:[^"\\\n]|\\.)*"?|\'[^\'\n]*\'?|#[^\n]*'
)
_NOT_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-\x00. \t]+")


def _decode(data: str | bytes, what: str) -> str:
    """The text as a str, after the size check (which comes before any parsing)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
        if len(raw) > MAX_TOML_BYTES:
            raise ModelFormatError(f"{what}: {len(raw)} bytes exceeds the TOML limit of {MAX_TOML_BYTES} bytes")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelFormatError(f"{what}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not isinstance(data, str):
        raise TypeError(f"TOML text must be str or bytes, not {type(data).__name__}")
    if len(data) > MAX_TOML_BYTES:  # every character is at least one UTF-8 byte
        raise ModelFormatError(f"{what}: {len(data)} characters exceeds the TOML limit of {MAX_TOML_BYTES} bytes")
    try:  # also rejects lone surrogates, which no name may carry
        size = len(data.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ModelFormatError(f"{what}: not valid Unicode ({e.reason} at character {e.start})") from None
    if size > MAX_TOML_BYTES:
        raise ModelFormatError(f"{what}: {size} bytes (UTF-8) exceeds the TOML limit of {MAX_TOML_BYTES} bytes")
    return data


def _deep_dotted_key(text: str) -> bool:
    """Whether a dotted key has more than MAX_TOML_DEPTH parts, in linear time: strings and
    comments are blanked, then every run of key characters and dots is measured (in valid TOML
    only a dotted key has more than one dot in such a run)."""
    skeleton = _STRINGS_AND_COMMENTS.sub(lambda m: "" if m.group()[:1] == "#" else "\x00", text)
    return any(run.count(".") >= MAX_TOML_DEPTH for run in _NOT_KEY_CHARS.split(skeleton))


def _too_deep(doc: dict) -> bool:
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        obj, depth = stack.pop()
        if depth > MAX_TOML_DEPTH:
            return True
        items = obj.values() if isinstance(obj, dict) else obj
        stack.extend((v, depth + 1) for v in items if isinstance(v, (dict, list)))
    return False


def parse_toml(data: str | bytes, what: str) -> dict:
    """Parse a TOML document; ``what`` names the source in every error message."""
    text = _decode(data, what)
    if _deep_dotted_key(text):
        raise ModelFormatError(f"{what}: refused before parsing: a dotted key has more than {MAX_TOML_DEPTH} parts")
    try:
        doc = tomllib.loads(text)
    except RecursionError:
        raise ModelFormatError(f"{what}: invalid TOML: nested too deeply to parse") from None
    except (ValueError, MemoryError, OverflowError) as e:  # TOMLDecodeError is a ValueError
        raise ModelFormatError(f"{what}: invalid TOML: {e}") from None
    if _too_deep(doc):
        raise ModelFormatError(f"{what}: tables and arrays nest deeper than {MAX_TOML_DEPTH}")
    return doc

"""Text <-> token ids through a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library).

``dist-runtime convert`` copies ``HF_DIR/tokenizer.json`` beside the ``.model`` and names it in the
metadata (``tokenizer = "NAME.tokenizer.json"``); :func:`find_tokenizer` finds it again.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..errors import DistRuntimeError


class Tokenizer:
    """Encode text to ids and decode ids to text, as ``transformers``' fast tokenizers do."""

    def __init__(self, path: str | Path, max_length: int | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise DistRuntimeError("text prompts need the 'tokenizers' package: "
                                   "pip install 'dist-runtime[importers]' (or pass --ids)") from None
        self.path = Path(path)
        try:
            self._tok = _Tokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception for unreadable files
            raise DistRuntimeError(f"cannot read tokenizer {self.path}: {e}") from None
        if max_length is not None:  # the model's limit (e.g. its max_seq_length) over the file's
            self._tok.enable_truncation(max_length)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``, with the special tokens the tokenizer adds (e.g. Llama's BOS) unless
        ``add_special_tokens`` is False (text rendered by a chat template already holds them)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token(self, id: int) -> str | None:
        """The vocabulary entry of ``id`` (e.g. ``</s>``), or None outside the vocabulary."""
        return self._tok.id_to_token(id)


class StreamDecoder:
    """Text of a growing list of ids, handed out piece by piece as tokens arrive.

    Decoding the whole list each time (not each token alone) keeps the spacing and multi-byte
    characters right; text that ends in U+FFFD (an incomplete UTF-8 sequence) is held back until
    the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.shown):
            return ""
        new, self.shown = text[len(self.shown):], text
        return new

    def finish(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        text = self.tokenizer.decode(self.ids)
        new = text[len(self.shown):] if text.startswith(self.shown) else ""
        self.shown += new
        return new


def find_tokenizer(model_path: str | Path, metadata: Mapping, override: str | Path | None = None) -> Path | None:
    """The tokenizer.json to use: ``override`` (a file, or a directory holding tokenizer.json), else
    the one the model's metadata names beside the model file, else None."""
    if override is not None:
        p = Path(override)
        p = p / "tokenizer.json" if p.is_dir() else p
        if not p.is_file():
            raise DistRuntimeError(f"no tokenizer at {p}")
        return p
    name = metadata.get("tokenizer")
    if isinstance(name, str):
        p = Path(model_path).parent / name
        if p.is_file():
            return p
    return None

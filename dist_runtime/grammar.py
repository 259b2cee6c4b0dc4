"""Constrained sampling: a session's tokens restricted to what a grammar allows (JSON mode and JSON
schemas for ``response_format``), with llguidance (docs/serving.md says why it).

A :class:`Constraint` per session keeps its grammar's state: before each sample its
:meth:`~Constraint.mask` sets the logits of every token the grammar refuses to -inf, after it
:meth:`~Constraint.advance` takes the chosen token; :attr:`~Constraint.finished` says when the
grammar is complete (the session then ends, as at a stop token).  The mask depends on the
session's own tokens only, so a session's tokens stay the same alone or batched.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from .errors import DistRuntimeError

#: llguidance's JSON compiler options: compact JSON (no free whitespace, which a weak model can
#: fill until max_tokens), every property of a strict schema in order.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarTokenizer:
    """A model's tokenizer as llguidance reads it: its tokenizer.json text, the logits' width and
    the end-of-sequence ids (building it takes up to ~1 s for a large vocabulary: build it once)."""

    def __init__(self, tokenizer_json: str, vocab: int, eos: Sequence[int]) -> None:
        from llguidance import LLTokenizer

        if not eos:
            raise DistRuntimeError("structured output needs the model's end-of-sequence id (eos_token_id)")
        try:
            self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=list(eos))
        except Exception as e:  # noqa: BLE001 -- a tokenizer llguidance cannot read: say so
            raise DistRuntimeError(f"structured output: the tokenizer cannot be used for it ({e})") from None
        self.vocab = vocab


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar of JSON text matching ``schema`` (None: any JSON object, JSON mode)."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_json_schema({"type": "object"} if schema is None else schema,
                                                  overrides=JSON_OPTIONS)
    except Exception as e:  # noqa: BLE001 -- whatever the compiler refuses, the client hears why
        raise DistRuntimeError(f"the JSON schema cannot be compiled: {e}") from None


class Constraint:
    """One session's grammar state (see the module docstring)."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str) -> None:
        from llguidance import LLMatcher
        from llguidance.numpy import allocate_token_bitmask

        self.matcher = LLMatcher(tokenizer.tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise DistRuntimeError(f"the grammar cannot be used: {self.matcher.get_error()}")
        self.vocab = tokenizer.vocab
        self._bitmask = allocate_token_bitmask(1, tokenizer.vocab)

    @classmethod
    def json(cls, tokenizer: GrammarTokenizer, schema: dict | None) -> Constraint:
        return cls(tokenizer, json_grammar(schema))

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` (one row) with every token the grammar refuses now at -inf (a copy)."""
        from llguidance.numpy import apply_token_bitmask_inplace, fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        row = np.array(logits[:self.vocab], np.float32)[None]
        apply_token_bitmask_inplace(row, self._bitmask)
        return row[0]

    def advance(self, token: int) -> None:
        """The session took ``token`` (which :meth:`mask` allowed)."""
        if not self.matcher.consume_token(token):
            raise DistRuntimeError(f"token {token} breaks the grammar: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but the end of the text may follow."""
        return self.matcher.is_stopped()


def schema_of(text: str) -> dict:
    """A JSON schema given as text; a DistRuntimeError naming what is wrong."""
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise DistRuntimeError(f"the JSON schema is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise DistRuntimeError("a JSON schema is a JSON object")
    return schema

"""The model a server serves: what clients may ask of it (its name, kind, context, vocabulary,
tokenizer, chat template), read once from the model file without its weights."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DistRuntimeError
from .text import find_chat_template


@dataclass
class ServedModel:
    id: str  # the name clients give as "model"
    path: Path
    kind: str  # "generate" (completions, chat) or "embed" (a sentence_embedding output)
    metadata: dict
    context: int | None  # prompt + max_tokens at most; None: unbounded
    vocab: int | None
    stop: frozenset[int]  # end-of-sequence ids
    tokenizer_path: Path | None
    tokenizer: object | None  # importers.tokenizer.Tokenizer
    chat_template: str | None
    created: int = field(default_factory=lambda: int(time.time()))
    _grammar_tokenizer: object = field(default=None, repr=False)

    @classmethod
    def open(cls, path: str | Path, *, context: int | None = None, tokenizer: str | Path | None = None,
             chat_template: str | Path | None = None, name: str | None = None) -> ServedModel:
        """Read ``path``'s metadata and graph; ``context`` caps the model's own context length (a
        pipeline's KV caches are sized for it)."""
        from ..engine import generative_io, stop_ids
        from ..importers.tokenizer import Tokenizer, find_tokenizer
        from ..model import load_model

        path = Path(path)
        with load_model(path, tensors=[]) as model:
            metadata, graph = model.metadata, model.graph
        if graph is None:
            raise DistRuntimeError(f"{path} has no graph section: there is nothing to serve")
        if "sentence_embedding" in graph.outputs:
            kind = "embed"
        else:
            generative_io(graph)  # the error says what this graph is instead
            kind = "generate"
        config = metadata.get("config") if isinstance(metadata.get("config"), dict) else {}
        known = [c for c in (config.get("context_length"), context) if isinstance(c, int) and c > 0]
        tok_path = find_tokenizer(path, metadata, tokenizer)
        if kind == "embed" and tok_path is None:
            raise DistRuntimeError(f"{path} has no tokenizer beside it; pass --tokenizer PATH")
        tok = Tokenizer(tok_path, metadata.get("max_seq_length") if kind == "embed" else None) if tok_path else None
        return cls(id=name or path.stem, path=path, kind=kind, metadata=metadata,
                   context=min(known) if known else None, vocab=config.get("vocab"),
                   stop=stop_ids(metadata), tokenizer_path=tok_path, tokenizer=tok,
                   chat_template=find_chat_template(tok_path, chat_template, metadata) if kind == "generate" else None)

    def grammar_tokenizer(self):
        """The tokenizer as the grammar engine reads it (:class:`..grammar.GrammarTokenizer`),
        built on first use and kept; a DistRuntimeError when the model has none."""
        if self._grammar_tokenizer is None:
            from ..grammar import GrammarTokenizer

            if self.tokenizer_path is None:
                raise DistRuntimeError(f"model {self.id!r} has no tokenizer: structured output needs one")
            vocab = self.vocab or self.tokenizer.vocab_size()
            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer_path.read_text(encoding="utf-8"), vocab,
                                                       sorted(self.stop))
        return self._grammar_tokenizer

    def special_tokens(self) -> dict:
        """The names a chat template may use for the special tokens (bos_token, eos_token)."""
        if self.tokenizer is None:
            return {}
        out = {}
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id")):
            value = self.metadata.get(key, (self.metadata.get("config") or {}).get(key))
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int):
                out[name] = self.tokenizer.token(value) or ""
        return out

"""The ONNX importer's error (``model`` and ``external`` raise it; ``model`` exports it)."""

from __future__ import annotations

from ...errors import DistRuntimeError

__all__ = ["OnnxImportError"]


class OnnxImportError(DistRuntimeError):
    """The ONNX file cannot be imported: unreadable, malformed, or outside what we import."""

"""``BackendHint``: the values a node's ``u8 backend_hint`` may take (docs/format.md, "Backend hints")."""

from __future__ import annotations

import enum


class BackendHint(enum.IntEnum):
    """Values of a node's ``u8 backend_hint``.  The numpy CPU library is always present; the others
    name backends that may be registered (docs/architecture.md, "Backends")."""

    CPU = 0
    METAL = 1  # the seed's honeycrisp
    WGPU = 2
    TORCH = 3  # kept (the value is part of the file format), though no backend serves it today
    NUMBA = 4

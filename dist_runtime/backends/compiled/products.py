"""The product table: one record per weight type, as ggml's type traits are for its types.

Every compiled product goes through it -- :func:`.linear`, :func:`.linear_many` and the compiled
program's builder (``program/builder.py``) alike.  A weight type's record names its block size
and, for each kind of activations a backend may ask for (``"f32"``, ``"q8_0"``: llama.cpp's
numerics), the :class:`~.registry.Route` that runs it: its family, its format code there, its
rows kernel, its joint kernel and its tile.  A type whose kernels have one kind of activations
only gives that route for both (the float types: their products are f32 whatever is asked).
Q8_0's elements are exact in f32, so with f32 activations it runs the float tiles (which share a
decoded piece among 8 rows of ``x``), and with q8_0 ones the legacy blocks' integer dots.
"""

from __future__ import annotations

from typing import NamedTuple

from ...dtypes import DType
from . import floats, kquants, legacy
from .registry import Route

#: The kinds of activations a product may take.
ACTIVATIONS = ("f32", "q8_0")


class WeightType(NamedTuple):
    """One weight type's products: its block (elements along K; 1 for floats) and its route for
    each kind of activations in :data:`ACTIVATIONS`."""

    block: int
    f32: Route
    q8_0: Route

    def route(self, activations: str) -> Route:
        return self.f32 if activations == "f32" else self.q8_0


def _blocks(module, dtype: DType, block: int) -> WeightType:
    return WeightType(block, module.route(dtype, False), module.route(dtype, True))


PRODUCTS: dict[DType, WeightType] = {
    DType.F32: WeightType(1, floats.ROUTES["f32"], floats.ROUTES["f32"]),
    DType.F16: WeightType(1, floats.ROUTES["f16"], floats.ROUTES["f16"]),
    DType.BF16: WeightType(1, floats.ROUTES["bf16"], floats.ROUTES["bf16"]),
    DType.Q8_0: WeightType(32, floats.ROUTES["q8_0"], legacy.route(DType.Q8_0, True)),
    DType.Q4_0: _blocks(legacy, DType.Q4_0, 32),
    DType.Q4_1: _blocks(legacy, DType.Q4_1, 32),
    DType.Q5_0: _blocks(legacy, DType.Q5_0, 32),
    DType.Q5_1: _blocks(legacy, DType.Q5_1, 32),
    DType.Q4_K: _blocks(kquants, DType.Q4_K, 256),
    DType.Q5_K: _blocks(kquants, DType.Q5_K, 256),
    DType.Q6_K: _blocks(kquants, DType.Q6_K, 256),
}


def route(dtype: DType, activations: str) -> Route:
    """The route of ``dtype``'s products with ``activations``; a ValueError naming what is missing."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    record = PRODUCTS.get(dtype)
    if record is None:
        raise ValueError(f"no compiled product for {getattr(dtype, 'name', dtype)} weights; "
                         f"the product table has {', '.join(d.name for d in PRODUCTS)}")
    return record.route(activations)

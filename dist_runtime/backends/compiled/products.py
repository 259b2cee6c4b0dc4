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

#: The kinds of activations a product may take; "auto", each weight type's default
#: (:attr:`WeightType.default`).
ACTIVATIONS = ("auto", "f32", "q8_0")


class WeightType(NamedTuple):
    """One weight type's products: its block (elements along K; 1 for floats), its route for
    each kind of activations, and the kind it takes by default (``"auto"``)."""

    block: int
    f32: Route
    q8_0: Route
    default: str = "f32"

    def route(self, activations: str) -> Route:
        kind = self.default if activations == "auto" else activations
        return self.f32 if kind == "f32" else self.q8_0


#: Block types multiply q8_0 activations by default, as llama.cpp does: 3072 x 3072, one row, two
#: threads, 158 against 965 us for Q4_0, 189 against 346 for Q8_0 (and 2-6x for the K-quants,
#: benchmarks/bench_decode.py), while the activations' rounding adds little to the weights' own:
#: relative error 7.0e-3 against 5.5e-3 for Q8_0, 7.8e-2 against 7.7e-2 for Q4_0; logits of the
#: test models within 2e-2 of the f32 activations' (tests/test_numerics.py).
def _blocks(module, dtype: DType, block: int) -> WeightType:
    return WeightType(block, module.route(dtype, False), module.route(dtype, True), "q8_0")


PRODUCTS: dict[DType, WeightType] = {
    DType.F32: WeightType(1, floats.ROUTES["f32"], floats.ROUTES["f32"]),
    DType.F16: WeightType(1, floats.ROUTES["f16"], floats.ROUTES["f16"]),
    DType.BF16: WeightType(1, floats.ROUTES["bf16"], floats.ROUTES["bf16"]),
    DType.Q8_0: WeightType(32, floats.ROUTES["q8_0"], legacy.route(DType.Q8_0, True), "q8_0"),
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

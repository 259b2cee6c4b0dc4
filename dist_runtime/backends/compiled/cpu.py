"""What this CPU offers the kernels, decided once at import, with the reason (``inspect --plan``)."""

from __future__ import annotations

import os


def _features() -> set[str]:
    try:
        from llvmlite import binding

        return {name for name, on in binding.get_host_cpu_features().items() if on}
    except Exception:  # noqa: BLE001 -- no feature list: the portable path, which runs anywhere
        return set()


FEATURES = _features()
#: The vector path (LLVM vector IR: AVX2 integer dot products, FMA on f32) or the portable one.
#: ``DIST_RUNTIME_PORTABLE=1`` forces the portable path (its tests run on any machine).
AVX2 = {"avx2", "fma", "f16c"} <= FEATURES and os.environ.get("DIST_RUNTIME_PORTABLE") != "1"
PATH = "avx2" if AVX2 else "portable"
#: 32 vector registers (AVX-512VL gives 256-bit operations the registers 16-31): room for the F32
#: kernels' tiles of 8 rows of ``x`` (floats.ROWS, floats.TILES).  Only the tile shape depends on it, not the bits.
REGISTERS = 32 if {"avx512f", "avx512vl"} <= FEATURES else 16
#: 8-bit dot products in one instruction (``vpdpbusd``, ``vpdpwssd``: AVX-VNNI or AVX-512 VNNI on
#: 256-bit registers) in place of ``pmaddubsw`` then ``pmaddwd``: the same exact integer sums.
#: Decided by the CPU alone, never by a setting: numba's cache is keyed by the CPU, and the same
#: jitted functions compile either way.
VNNI = AVX2 and ("avxvnni" in FEATURES or {"avx512vnni", "avx512vl"} <= FEATURES)
#: 512-bit block products (the legacy types' with Q8_0 activations, :mod:`.simd_int8`): four blocks
#: in one register, their codes and scales gathered by one byte permute each (``vpermt2b``, VBMI),
#: their dots by 512-bit ``vpdpbusd``.  Only the speed depends on it, not the bits: the 256-bit
#: path computes the same lanes as two halves.  One thread, Q4_0 in cache, M = 1: 2.0-2.3x the
#: 256-bit path's speed.
WIDE = VNNI and {"avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512vnni"} <= FEATURES
REASON = ("AVX2, FMA and F16C present: vector kernels" if AVX2 else
          "portable kernels: " + ("forced by DIST_RUNTIME_PORTABLE=1" if os.environ.get("DIST_RUNTIME_PORTABLE") == "1"
                                  else f"this CPU lacks {', '.join(sorted({'avx2', 'fma', 'f16c'} - FEATURES))}"))
REASON += f"; {REGISTERS} vector registers" + ("; VNNI dot products" if VNNI else "") + (
    "; 512-bit block products" if WIDE else "")

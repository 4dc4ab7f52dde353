#!/usr/bin/env python3
"""Writes the q8_0 / nvfp4 fixtures of ops/tests/fixtures/quant/ (read by ops/tests/quant_fixtures.rs).

Usage:  pip install gguf==0.19.0 numpy  &&  python3 tools/gen_quant_fixtures.py

Every case is N = 256 f32 values (8 q8_0 blocks, 4 nvfp4 blocks) and gives five little-endian files:

    <case>.f32.bin             the input
    <case>.q8_0.bin            gguf.quants.quantize(input, Q8_0)
    <case>.q8_0.dequant.bin    gguf.quants.dequantize(<case>.q8_0.bin, Q8_0)
    <case>.nvfp4.bin           nvfp4_quantize(input), see below
    <case>.nvfp4.dequant.bin   gguf.quants.dequantize(<case>.nvfp4.bin, NVFP4)

gguf 0.19.0 can dequantize NVFP4 but not quantize it (NVFP4.quantize_blocks is missing), so
nvfp4_quantize below restates ggml's quantize_row_nvfp4_ref (ggml/src/ggml-quants.c) in numpy, using
the package's own UE4M3 encoder/decoder and E2M1 table. Its output was checked byte-for-byte against
ggml's C reference compiled from source when these fixtures were made.

The output is deterministic: rerunning the script must leave `git status` clean.
"""

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import NVFP4, dequantize, quantize

N = 256
OUT = Path(__file__).resolve().parent.parent / "ops" / "tests" / "fixtures" / "quant"


def nvfp4_quantize(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_nvfp4_ref: per 16 values, scale = ue4m3(amax / 6), then nearest E2M1 code."""
    sub = x.astype(np.float32).reshape(-1, 16)
    # C's `if (amax < fabsf(v)) amax = fabsf(v)` skips NaN.
    amax = np.where(np.isnan(sub), np.float32(0), np.abs(sub)).max(axis=1)
    codes = NVFP4.fp32_to_ue4m3(amax / np.float32(6.0))
    d = NVFP4.ue4m3_to_fp32(codes).astype(np.float32)  # half the scale: the table below is doubled
    grid = np.array(NVFP4.kvalues, dtype=np.float32)
    err = np.abs(grid[None, None, :] * d[:, None, None] - sub[:, :, None])
    idx = np.argmin(err, axis=-1).astype(np.uint8)  # first minimum = ggml's strict `<`; NaN/inf rows -> 0
    qs = idx[:, :8] | (idx[:, 8:] << 4)  # element j in the low nibble, j + 8 in the high one
    blocks = np.concatenate([codes.reshape(-1, 4), qs.reshape(-1, 32)], axis=1)
    return blocks.astype(np.uint8).reshape(-1)


def grid_ties() -> np.ndarray:
    """Sub-blocks whose amax is exactly 6 * s: every E2M1 grid point and every midpoint between two."""
    on_grid = [6, 0, 0.5, 1, 1.5, 2, 3, 4, -6, -0.5, -1, -1.5, -2, -3, -4, -0.0]
    ties = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6]
    scales = [1.0, 0.25, 3.0, 2.0**-8, 1.5 * 2.0**-7, 448.0, 104.0, 2.0**-6]
    return np.concatenate([np.array(p) * s for s in scales for p in (on_grid, ties)])


def q8_ties(rng: np.random.Generator) -> np.ndarray:
    """q8_0 blocks with an exact d (a power of two) holding half-integer multiples of d."""
    blocks = []
    for d in [1.0, 2.0**-4, 2.0**10, 2.0**-20]:
        k = np.arange(32) - 15.5  # -15.5 .. 15.5: all ties
        k[0], k[1] = 127, -126.5
        blocks.append(rng.permutation(k) * d)
    for amax in [100.0, 0.3, 7e-3, 5e3]:  # inexact d and 1/d
        b = (rng.integers(-127, 127, 32) + 0.5) * amax / 127
        b[rng.integers(32)] = -amax
        blocks.append(b)
    return np.concatenate(blocks)


def scale_edges(rng: np.random.Generator) -> np.ndarray:
    """One nvfp4 sub-block per interesting value of amax / 6 (the UE4M3 encoder's input)."""
    targets = [
        1.0,  # exact
        1.0625,  # halfway 1 .. 1.125: ggml rounds half up
        1.0624999,  # just below that tie
        2.0**-6,  # smallest normal
        7.75 / 512,  # subnormal, rounds to 8/512 but ggml caps the subnormal mantissa at 7
        1.5 / 512,  # subnormal tie: (x * 512 + 0.5) truncated
        0.5 / 512,  # smallest value still encoded as nonzero
        0.49 / 512,  # encodes as 0: the whole sub-block is zero
        240.0,  # largest code below exponent 15 (0x77)
        248.0,  # rounds up into exponent 15: ggml saturates to 0x7E (448)
        300.0,  # exponent 15: 0x7E
        448.0,  # the largest finite e4m3
        1000.0,  # clamped to 448
        0.013,  # subnormal, inexact
        37.3,  # normal, inexact
        3.0e-3,  # subnormal, inexact
    ]
    subs = []
    for t in targets:
        amax = np.float32(t) * np.float32(6)
        sub = rng.uniform(-1.0, 1.0, 16).astype(np.float32) * amax
        sub[rng.integers(16)] = amax if rng.integers(2) else -amax
        subs.append(sub)
    return np.concatenate(subs)


def cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20260521)
    magnitudes = [1e-5, 1e-3, 1e-2, 0.1, 1.0, 10.0, 1e3, 1e4]  # tiny to huge, one q8_0 block each
    signed_zeros = np.concatenate([
        np.zeros(32), np.full(32, -0.0),
        np.where(np.arange(32) == 9, 1.0, -0.0),
        np.concatenate([[-1.0], -rng.uniform(0, 0.01, 31)]),  # rounds to -0.0 before the i8 cast
        rng.standard_normal(128),
    ])
    special = np.concatenate([
        np.where(np.arange(32) == 5, np.nan, rng.standard_normal(32)),
        np.where(np.arange(32) == 7, np.inf, rng.standard_normal(32)),
        np.where(np.arange(32) == 30, -np.inf, rng.standard_normal(32)),
        np.where(np.arange(32) == 31, np.nan, rng.standard_normal(32)),
        rng.uniform(-1e-40, 1e-40, 32),  # f32 subnormals: 1/d overflows to inf
        rng.standard_normal(32) * 2e7,  # amax / 127 overflows f16: d = inf
        rng.standard_normal(32) * 1e-7,  # d rounds to f16 zero, the quants do not
        rng.standard_normal(32),
    ])
    return {
        "normal": rng.standard_normal(N),
        "magnitudes": np.concatenate([rng.standard_normal(32) * m for m in magnitudes]),
        "signed_zeros": signed_zeros,
        "grid_ties": grid_ties(),
        "q8_ties": q8_ties(rng),
        "scale_edges": scale_edges(rng),
        "special": special,
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    all_cases = cases()
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for name, values in all_cases.items():
            x = np.asarray(values, dtype=np.float32)
            assert x.shape == (N,), name
            q8 = quantize(x.reshape(1, N), GGMLQuantizationType.Q8_0).reshape(-1)
            fp4 = nvfp4_quantize(x)
            files = {
                "f32": x,
                "q8_0": q8,
                "q8_0.dequant": dequantize(q8, GGMLQuantizationType.Q8_0).astype(np.float32),
                "nvfp4": fp4,
                "nvfp4.dequant": dequantize(fp4, GGMLQuantizationType.NVFP4).astype(np.float32),
            }
            for suffix, data in files.items():
                (OUT / f"{name}.{suffix}.bin").write_bytes(data.astype(data.dtype.newbyteorder("<")).tobytes())
    total = sum(p.stat().st_size for p in OUT.glob("*.bin"))
    print(f"wrote {len(all_cases)} cases to {OUT} ({total} bytes)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Compares Tessera's logits with llama.cpp's on the same GGUF and ids 1..N.

    python3 tools/llama_logits_nmse.py OURS.safetensors LLAMA.bin

OURS: `tessera run F.gguf --backend cpu --tokens 1,2,..,N -n 1 --kv-dtype f32 --dump-logits OURS`
(`seq0.logits` [N, n_vocab]); LLAMA: `../shared/tools/llama-anchor cpu-logits F.gguf N LLAMA`
(f32 [N, n_vocab], position-major). Prints the NMSE of all logits, the worst position's NMSE, and
the top-1 agreement at every position. Needs numpy only (the safetensors header is parsed here).
"""
import json
import struct
import sys

import numpy as np


def read_safetensors(path, name):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8 : 8 + n])[name]
    assert h["dtype"] == "F32", h
    lo, hi = h["data_offsets"]
    return np.frombuffer(b[8 + n + lo : 8 + n + hi], dtype="<f4").reshape(h["shape"])


def main():
    ours = read_safetensors(sys.argv[1], "seq0.logits").astype(np.float64)
    ref = np.fromfile(sys.argv[2], dtype="<f4").astype(np.float64).reshape(ours.shape[0], -1)
    assert ref.shape == ours.shape, (ref.shape, ours.shape)
    nmse = ((ours - ref) ** 2).sum() / (ref**2).sum()
    per_pos = ((ours - ref) ** 2).sum(1) / (ref**2).sum(1)
    top1 = (ours.argmax(1) == ref.argmax(1))
    print(
        f"positions {ours.shape[0]}, vocab {ours.shape[1]}: nmse {nmse:.3e} (worst position {per_pos.max():.3e}), "
        f"max |diff| {np.abs(ours - ref).max():.3e}, top-1 equal at {top1.sum()}/{len(top1)} positions"
    )
    ok = nmse <= 1e-6 and top1.all()
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

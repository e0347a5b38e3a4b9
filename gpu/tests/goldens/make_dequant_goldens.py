#!/usr/bin/env python3
"""Regenerates gpu/tests/goldens/dequant.json: reference dequantizations from the `gguf` Python
package (numpy), which we did not write, for lockstep's own dequantizer to be held to.

- For every tensor type lockstep reads: a few blocks of seeded random bytes (scales kept finite),
  and their values.
- From the default model (path as the first argument, from ci/fetch-default-model.sh): the first
  two rows of one tensor of each type it has, and a sum over each tensor's first 64 rows.

Run: python3 -m pip install gguf==0.19.0 numpy && \
     python3 gpu/tests/goldens/make_dequant_goldens.py "$(ci/fetch-default-model.sh)"
"""
import json
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

# (name, type, bytes per block, offsets of f16 scales to keep finite)
TYPES = [
    ("F32", T.F32, 4, []),
    ("F16", T.F16, 2, [0]),
    ("BF16", T.BF16, 2, []),
    ("Q4_0", T.Q4_0, 18, [0]),
    ("Q4_1", T.Q4_1, 20, [0, 2]),
    ("Q8_0", T.Q8_0, 34, [0]),
    ("Q4_K", T.Q4_K, 144, [0, 2]),
    ("Q6_K", T.Q6_K, 210, [208]),
    ("Q5_0", T.Q5_0, 22, [0]),
    ("Q5_1", T.Q5_1, 24, [0, 2]),
    ("Q5_K", T.Q5_K, 176, [0, 2]),
]


def finite_half(rng):
    return np.float16(rng.uniform(-2.0, 2.0)).tobytes()


def random_blocks(rng, type_, block_bytes, scale_offsets, blocks):
    if type_ == T.F32:
        return np.float32(rng.uniform(-4, 4, size=blocks)).tobytes()
    if type_ == T.BF16:
        return (np.float32(rng.uniform(-4, 4, size=blocks)).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    out = bytearray(rng.integers(0, 256, size=block_bytes * blocks, dtype=np.uint8).tobytes())
    for b in range(blocks):
        for at in scale_offsets:
            out[b * block_bytes + at : b * block_bytes + at + 2] = finite_half(rng)
    return bytes(out)


def main():
    rng = np.random.default_rng(20261202)
    golden = {"random": {}, "model": {}}
    for name, type_, block_bytes, scales in TYPES:
        blocks = 3
        raw = random_blocks(rng, type_, block_bytes, scales, blocks)
        values = dequantize(np.frombuffer(raw, dtype=np.uint8), type_).astype(np.float32).ravel()
        golden["random"][name] = {"bytes": raw.hex(), "values": [float(v) for v in values]}
    if len(sys.argv) > 1:
        reader = GGUFReader(sys.argv[1])
        seen = set()
        for tensor in reader.tensors:
            type_name = tensor.tensor_type.name
            rows = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            rows = rows.reshape(-1, rows.shape[-1]) if rows.ndim > 1 else rows.reshape(1, -1)
            entry = {"type": type_name, "sum_first_64_rows": float(np.sum(rows[:64], dtype=np.float64))}
            if type_name not in seen:
                seen.add(type_name)
                entry["first_rows"] = [[float(v) for v in row] for row in rows[:2]]
            golden["model"][tensor.name] = entry
    json.dump(golden, open("gpu/tests/goldens/dequant.json", "w"), indent=0)


if __name__ == "__main__":
    main()

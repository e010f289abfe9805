"""Write a GGUF's model again in other ggml block types: each matrix is dequantized by the `gguf`
package and encoded by `block_encode.py` (Q2_K, Q3_K, IQ4_NL, IQ4_XS) or by `gguf.quants`
(Q4_0 .. Q8_0); metadata, tokenizer, vectors, the embedding and the output head are copied as they
are. Test and benchmark models in the types people download, from a real model's weights.

    python scripts/requantize_gguf.py IN.gguf OUT.gguf --mix q3_k_m

Mixes (after llama.cpp's, within the encoders this project has):

    q3_k_m   Q3_K; attn_v, attn_output and ffn_down IQ4_XS (llama.cpp gives those Q4_K/Q5_K)
    q2_k     Q2_K; attn_v and ffn_down Q3_K
    iq4_xs   IQ4_XS                      iq4_nl   IQ4_NL
    rotate   ffn_down of layer i in Q2_K, Q3_K, IQ4_XS, IQ4_NL by i % 4; every other matrix IQ4_NL
    Q2_K, Q3_K, IQ4_NL, IQ4_XS, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: that type for every matrix

A matrix whose rows are not a multiple of 256 values takes llama.cpp's fallback for it: IQ4_NL for
Q2_K, Q3_K and IQ4_XS (so a small model's Q3_K_M file holds several types, as llama.cpp writes it).
"""

from __future__ import annotations

import argparse
import os
import sys

import gguf
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from deepinfer.model_executor.layers.ops.block_encode import encode_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
SUPER_BLOCK_TYPES = {"Q2_K", "Q3_K", "IQ4_XS"}  # 256-value blocks: IQ4_NL where a row does not fit
KEEP = ("token_embd.weight", "output.weight")
ROTATE = ("Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL")


def mix_type(mix: str, name: str) -> str:
    """The type `mix` gives matrix `name` (before the fallback for short rows)."""
    part = name.split(".")[-2] if name.count(".") >= 2 else name
    if mix == "q3_k_m":
        return "IQ4_XS" if part in ("attn_v", "attn_output", "ffn_down") else "Q3_K"
    if mix == "q2_k":
        return "Q3_K" if part in ("attn_v", "ffn_down") else "Q2_K"
    if mix == "rotate":
        return ROTATE[int(name.split(".")[1]) % 4] if part == "ffn_down" else "IQ4_NL"
    return {"iq4_xs": "IQ4_XS", "iq4_nl": "IQ4_NL"}.get(mix, mix)


def target_type(mix: str, name: str, row: int) -> str:
    kind = mix_type(mix, name)
    return "IQ4_NL" if kind in SUPER_BLOCK_TYPES and row % 256 else kind


def encode(values: np.ndarray, kind: str) -> np.ndarray:
    """float32 [N, K] -> the blocks' bytes uint8 [N, row bytes]."""
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return gguf.quants.quantize(values, Q[kind])
    return encode_blocks(values, kind)


def copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)


def requantize(src: str, dst: str, mix: str) -> dict[str, int]:
    """Write src's model to dst in `mix`; returns the count of matrices per type written."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    copy_fields(reader, writer)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        shape = [int(v) for v in reversed(t.shape)]  # torch order: [rows, K]
        if len(shape) != 2 or t.name in KEEP or not t.name.endswith(".weight"):
            writer.add_tensor(t.name, t.data, raw_dtype=None if t.tensor_type in (Q.F32, Q.F16) else t.tensor_type)
            continue
        kind = target_type(mix, t.name, shape[1])
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        writer.add_tensor(t.name, encode(values, kind), raw_dtype=Q[kind])
        counts[kind] = counts.get(kind, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--mix", required=True, help="q3_k_m, q2_k, iq4_xs, iq4_nl, rotate, or one ggml type name")
    args = ap.parse_args()
    counts = requantize(args.src, args.dst, args.mix)
    mib = os.path.getsize(args.dst) / 2**20
    print(f"wrote {args.dst}: {mib:,.1f} MiB; matrices " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()

"""Write a GGUF's model again in other ggml block types: each matrix is dequantized by the `gguf`
package and encoded by `block_encode.py` (Q2_K, Q3_K, IQ4_NL, IQ4_XS, the i-quants IQ1_S .. IQ3_S,
TQ1_0, TQ2_0) or by `gguf.quants` (Q4_0 .. Q8_0); metadata, tokenizer, vectors, the embedding and the
output head are copied as they are. Test and benchmark models in the types people download, from a
real model's weights.

    python scripts/requantize_gguf.py IN.gguf OUT.gguf --mix q3_k_m

Mixes (after llama.cpp's `llama_tensor_get_type`, within the encoders this project has; "the first
eighth" is ffn_down of layers below n_layer / 8):

    q3_k_m   Q3_K; attn_v, attn_output and ffn_down IQ4_XS (llama.cpp gives those Q4_K/Q5_K)
    q2_k     Q2_K; attn_v and ffn_down Q3_K
    iq4_xs   IQ4_XS                      iq4_nl   IQ4_NL
    iq2_xxs  IQ2_XXS; attn_v and the first eighth Q2_K
    iq2_m    IQ2_S; attn_v, attn_output and the first eighth IQ3_S
    iq3_xxs  IQ3_XXS; attn_q and attn_k IQ2_S, attn_v and attn_output IQ3_S (llama.cpp's choice with
             an importance matrix; without one it gives ffn_down Q3_K/Q4_K)
    iq1_s    IQ1_S; attn_v and the first eighth Q2_K, attn_output IQ2_XXS     iq1_m   the same, IQ1_M
    tq1_0    TQ1_0                       tq2_0    TQ2_0
    (llama.cpp gives attn_v Q4_K in the i-quant mixes when a model has 4 or more query heads per
    KV head; these mixes keep the choice above)
    rotate   ffn_down of layer i in Q2_K, Q3_K, IQ4_XS, IQ4_NL by i % 4; every other matrix IQ4_NL
    rotate2  ffn_down of layer i in IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0,
             TQ2_0 by i % 9; every other matrix as the source has it
    rotate_all  ffn_down of layers 0..12 in the 13 types of rotate and rotate2, one each; every other
             matrix as the source has it (one 2- or 1-bit matrix per type: the model stays sharp
             enough that its tokens test the arithmetic, not the quantization)
    Q2_K, Q3_K, IQ4_NL, IQ4_XS, IQ1_S, .. TQ2_0, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: that type everywhere

A matrix whose rows are not a multiple of its type's 256-value block takes llama.cpp's fallback:
IQ4_NL for the i-quants, IQ4_XS, Q2_K and Q3_K (so a small model's Q3_K_M file holds several types,
as llama.cpp writes it; llama.cpp now gives Q2_K and Q3_K Q4_0, as it does TQ1_0 and TQ2_0 here).
"""

from __future__ import annotations

import argparse
import os
import sys

import gguf
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from deepinfer.model_executor.layers.ops.block_encode import ENCODED_KINDS, encode_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
GRID_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")
FALLBACK = {**dict.fromkeys(("Q2_K", "Q3_K", "IQ4_XS", *GRID_TYPES), "IQ4_NL"), "TQ1_0": "Q4_0", "TQ2_0": "Q4_0"}
GGUF_QUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
KEEP = ("token_embd.weight", "output.weight")
ROTATE = ("Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL")
ROTATE2 = (*GRID_TYPES, "TQ1_0", "TQ2_0")
ROTATE_ALL = (*ROTATE, *ROTATE2)
# mix -> (type of most matrices, {matrix: type}, type of the first eighth of ffn_down or None)
IQ_MIXES = {
    "iq2_xxs": ("IQ2_XXS", {"attn_v": "Q2_K"}, "Q2_K"),
    "iq2_m": ("IQ2_S", {"attn_v": "IQ3_S", "attn_output": "IQ3_S"}, "IQ3_S"),
    "iq3_xxs": ("IQ3_XXS", {"attn_q": "IQ2_S", "attn_k": "IQ2_S", "attn_v": "IQ3_S", "attn_output": "IQ3_S"}, None),
    "iq1_s": ("IQ1_S", {"attn_v": "Q2_K", "attn_output": "IQ2_XXS"}, "Q2_K"),
    "iq1_m": ("IQ1_M", {"attn_v": "Q2_K", "attn_output": "IQ2_XXS"}, "Q2_K"),
}
MIXES = ("q3_k_m", "q2_k", "iq4_xs", "iq4_nl", "tq1_0", "tq2_0", "rotate", "rotate2", "rotate_all", *IQ_MIXES)
TYPES = (*ENCODED_KINDS, *GGUF_QUANTIZED)


def check_mix(mix: str) -> str:
    if mix not in MIXES and mix not in TYPES:
        raise ValueError(f"--mix {mix!r}: not a mix ({', '.join(MIXES)}) nor a type ({', '.join(TYPES)})")
    return mix


def mix_type(mix: str, name: str, n_layer: int = 0) -> str | None:
    """The type `mix` gives matrix `name` of a model of n_layer layers (before the fallback for short
    rows); None: the matrix stays as the source has it."""
    part = name.split(".")[-2] if name.count(".") >= 2 else name
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if mix == "q3_k_m":
        return "IQ4_XS" if part in ("attn_v", "attn_output", "ffn_down") else "Q3_K"
    if mix == "q2_k":
        return "Q3_K" if part in ("attn_v", "ffn_down") else "Q2_K"
    if mix == "rotate":
        return ROTATE[layer % 4] if part == "ffn_down" else "IQ4_NL"
    if mix == "rotate2":
        return ROTATE2[layer % 9] if part == "ffn_down" else None
    if mix == "rotate_all":
        return ROTATE_ALL[layer] if part == "ffn_down" and 0 <= layer < len(ROTATE_ALL) else None
    if mix in IQ_MIXES:
        base, by_part, first = IQ_MIXES[mix]
        if part == "ffn_down" and first is not None and layer < n_layer // 8:
            return first
        return by_part.get(part, base)
    return {"iq4_xs": "IQ4_XS", "iq4_nl": "IQ4_NL", "tq1_0": "TQ1_0", "tq2_0": "TQ2_0"}.get(mix, mix)


def target_type(mix: str, name: str, row: int, n_layer: int = 0) -> str | None:
    kind = mix_type(mix, name, n_layer)
    if kind is None or row % gguf.GGML_QUANT_SIZES[Q[kind]][0] == 0:
        return kind
    if kind not in FALLBACK:
        raise ValueError(f"{name}: rows of {row} values are not whole {kind} blocks, and {kind} has no fallback")
    return FALLBACK[kind]


def encode(values: np.ndarray, kind: str) -> np.ndarray:
    """float32 [N, K] -> the blocks' bytes uint8 [N, row bytes]."""
    if kind in GGUF_QUANTIZED:
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
    check_mix(mix)
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n_layer = int(reader.fields[f"{arch}.block_count"].contents())
    writer = gguf.GGUFWriter(dst, arch)
    copy_fields(reader, writer)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        shape = [int(v) for v in reversed(t.shape)]  # torch order: [rows, K]
        matrix = len(shape) == 2 and t.name not in KEEP and t.name.endswith(".weight")
        kind = target_type(mix, t.name, shape[1], n_layer) if matrix else None
        if kind is None:
            writer.add_tensor(t.name, t.data, raw_dtype=None if t.tensor_type in (Q.F32, Q.F16) else t.tensor_type)
            continue
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
    ap.add_argument("--mix", required=True, help=f"{', '.join(MIXES)}, or one ggml type name")
    args = ap.parse_args()
    try:
        check_mix(args.mix)
    except ValueError as e:
        ap.error(str(e))
    counts = requantize(args.src, args.dst, args.mix)
    mib = os.path.getsize(args.dst) / 2**20
    print(f"wrote {args.dst}: {mib:,.1f} MiB; matrices " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()

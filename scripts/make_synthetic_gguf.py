"""Write a real-size GGUF in the Qwen2 layout from random weights, for speed measurements (speed does
not depend on the values), and optionally a same-family draft model for speculative decoding.

    python scripts/make_synthetic_gguf.py OUT.gguf [--shape qwen2.5-1.5b | llama3.1-8b] [--vocab 151936]
        [--layers 28 --hidden 1536 --intermediate 8960 --heads 12 --kv-heads 2]
        [--draft OUT-draft.gguf --draft-layers 9 --extra-scale 0.05]

The target is Qwen2.5-1.5B's shape (28 layers, hidden 1536, FFN 8960, 12 heads, 2 KV heads of 128,
RoPE base 1e6, context 32768, tied embeddings) with the tokenizer of the embedded SmolLM2 GGUF
(49,152 tokens: a real BPE vocabulary and chat template, so llama.cpp and transformers both load it);
about 1.4 B parameters. `--vocab N` pads the vocabulary to N tokens (the extra ones unused control
tokens, `<|pad_i|>`) so that the embedding and LM head have a real model's size: Qwen2.5's 151,936
rows are ~18% of a 1.5B token's bytes, which a 49,152-token head understates. `--shape llama3.1-8b`
is Llama-3.1-8B's shape (32 layers, hidden 4096, FFN 14336, 32 heads, 8 KV heads of 128, RoPE base
5e5, an untied LM head, vocabulary 128,256 unless --vocab says otherwise) in the same Q4_K_M mix
(Q6_K LM head, the embedding Q4_K as llama.cpp writes it), written in the llama layout. Types follow llama.cpp's Q4_K_M mix: Q4_K everywhere, Q6_K for the embedding
(the LM head too, tied) and for attn_v / ffn_down on the layers where Q4_K_M spends more bits (the
first and last eighth, and every third between; `--mix q4_k`: Q4_K everywhere). Blocks are random
codes with fp16 scales sized for weights of standard deviation ~0.02; norms are ones, biases zeros.

The draft (`--draft`) is the target's first `--draft-layers` layers, byte for byte, with the same
embedding and final norm: a smaller model of the same family and tokenizer. So that it predicts the
target's tokens as a trained draft would (often, not always), the target's layers past the draft's
have their attention and FFN output projections scaled by `--extra-scale`: they nudge the residual
stream instead of rewriting it. The acceptance this gives is a property of the construction, not of
a trained pair: report it beside any speed-up.
"""

from __future__ import annotations

import argparse
import os

import gguf
import numpy as np

from deepinfer.model_executor.loader.default_model import default_model_path

Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                   "tokenizer.ggml.padding_token_id", "tokenizer.chat_template")


def q4_k_blocks(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """[rows, cols / 256 * 144] Q4_K blocks: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 of nibbles.
    A value is d * sc * q - dmin * m (q in 0..15, sc and m in 0..63): d puts the values near `std`,
    dmin = 7.5 d centres them."""
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    d = np.float16(std / (32 * 4.6))
    blocks[..., 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    blocks[..., 2:4] = np.frombuffer(np.float16(7.5 * d).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def q6_k_blocks(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """[rows, cols / 256 * 210] Q6_K blocks: 128 + 64 bytes of 6-bit codes, 16 int8 scales, d (fp16).
    A value is d * sc * (q - 32)."""
    blocks = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
    blocks[..., 192:208] = rng.integers(1, 64, (rows, cols // 256, 16), dtype=np.uint8)  # positive int8 scales
    blocks[..., 208:210] = np.frombuffer(np.float16(std / (32 * 18.5)).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def scaled(blocks: np.ndarray, kind, factor: float) -> np.ndarray:
    """The same blocks with every fp16 scale field times `factor` (the values scale with them)."""
    size = 144 if kind == Q4_K else 210
    out = blocks.copy().reshape(blocks.shape[0], -1, size)
    for at in ((0, 2) if kind == Q4_K else (208,)):
        field = out[..., at:at + 2].copy().view(np.float16)
        out[..., at:at + 2] = (field * np.float16(factor)).view(np.uint8)
    return out.reshape(blocks.shape)


def more_bits(layer: int, layers: int) -> bool:
    """Q4_K_M's layers whose attn_v and ffn_down take Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tokenizer_fields(path: str) -> dict:
    """The tokenizer keys of `path` (a GGUF), as (value, type) pairs for GGUFWriter.add_key_value."""
    reader = gguf.GGUFReader(path)
    fields = {}
    for key in _TOKENIZER_KEYS:
        field = reader.fields.get(key)
        if field is None:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            values = [field.parts[i] for i in field.data]
            values = [bytes(v).decode("utf-8") if sub == gguf.GGUFValueType.STRING else int(v[0]) for v in values]
            fields[key] = (values, kind, sub)
        elif kind == gguf.GGUFValueType.STRING:
            fields[key] = (bytes(field.parts[field.data[0]]).decode("utf-8"), kind, None)
        else:
            fields[key] = (field.parts[field.data[0]][0].item(), kind, None)
    return fields


SHAPES = {  # name: (layers, hidden, FFN, heads, KV heads, vocab, RoPE base, tied, architecture)
    "qwen2.5-1.5b": (28, 1536, 8960, 12, 2, None, 1e6, True, "qwen2"),
    "llama3.1-8b": (32, 4096, 14336, 32, 8, 128256, 5e5, False, "llama"),
}


def padded_vocab(tokenizer: dict, size: int | None) -> dict:
    """The tokenizer keys with the token list padded to `size` tokens (unused control tokens)."""
    tokens, kind, sub = tokenizer["tokenizer.ggml.tokens"]
    if size is None or size <= len(tokens):
        return tokenizer
    types, tkind, tsub = tokenizer["tokenizer.ggml.token_type"]
    extra = size - len(tokens)
    out = dict(tokenizer)
    out["tokenizer.ggml.tokens"] = (tokens + [f"<|pad_{i}|>" for i in range(extra)], kind, sub)
    out["tokenizer.ggml.token_type"] = (types + [int(gguf.TokenType.CONTROL)] * extra, tkind, tsub)
    return out


def layer_tensors(rng, layer: int, args) -> dict[str, tuple[np.ndarray, object]]:
    """One block's tensors by GGUF name: (data, ggml type or None for F32)."""
    h, f, hd = args.hidden, args.intermediate, args.hidden // args.heads
    kv = args.kv_heads * hd
    heavy = Q6_K if args.mix == "q4_k_m" and more_bits(layer, args.layers) else Q4_K
    make = {Q4_K: q4_k_blocks, Q6_K: q6_k_blocks}
    t = {
        "attn_norm.weight": (np.ones(h, np.float32), None),
        "ffn_norm.weight": (np.ones(h, np.float32), None),
        "attn_q.weight": (q4_k_blocks(rng, h, h, 0.02), Q4_K),
        "attn_q.bias": (np.zeros(h, np.float32), None),
        "attn_k.weight": (q4_k_blocks(rng, kv, h, 0.02), Q4_K),
        "attn_k.bias": (np.zeros(kv, np.float32), None),
        "attn_v.weight": (make[heavy](rng, kv, h, 0.02), heavy),
        "attn_v.bias": (np.zeros(kv, np.float32), None),
        "attn_output.weight": (q4_k_blocks(rng, h, h, 0.02), Q4_K),
        "ffn_gate.weight": (q4_k_blocks(rng, f, h, 0.02), Q4_K),
        "ffn_up.weight": (q4_k_blocks(rng, f, h, 0.02), Q4_K),
        "ffn_down.weight": (make[heavy](rng, h, f, 0.02), heavy),
    }
    if args.arch != "qwen2":  # Llama: no q/k/v biases
        t = {name: value for name, value in t.items() if not name.endswith(".bias")}
    return {f"blk.{layer}.{name}": value for name, value in t.items()}


def write_model(path: str, args, layers: int, tensors: dict, tokenizer: dict) -> None:
    writer = gguf.GGUFWriter(path, args.arch)
    writer.add_name(f"synthetic-{args.arch}-{layers}L-{args.hidden}")
    writer.add_context_length(args.context)
    writer.add_embedding_length(args.hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(args.intermediate)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_freq_base(args.rope_base)
    writer.add_layer_norm_rms_eps(1e-6 if args.arch == "qwen2" else 1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for key, (value, kind, sub) in tokenizer.items():
        writer.add_key_value(key, value, kind, sub_type=sub)
    for name, (data, kind) in tensors.items():
        if name.startswith("blk.") and int(name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(name, data, raw_dtype=kind)  # quantized: the shape is the blocks' bytes [rows, row bytes]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {path}: {layers} layers, {os.path.getsize(path) / 2**20:,.1f} MiB", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b",
                   help="the model's shape (the flags below override its parts)")
    p.add_argument("--vocab", type=int, default=None,
                   help="pad the vocabulary to this many tokens (default: the shape's, else the tokenizer's 49,152)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--draft", default=None, help="also write the draft model here")
    p.add_argument("--draft-layers", type=int, default=9)
    p.add_argument("--extra-scale", type=float, default=0.05,
                   help="output-projection scale of the target's layers past the draft's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mix", choices=["q4_k_m", "q4_k"], default="q4_k_m",
                   help="q4_k_m: llama.cpp's mix (Q6_K embedding, attn_v and ffn_down on some layers); q4_k: Q4_K only")
    args = p.parse_args()
    layers, hidden, ffn, heads, kv_heads, vocab_size, args.rope_base, tied, args.arch = SHAPES[args.shape]
    for name, value in (("layers", layers), ("hidden", hidden), ("intermediate", ffn), ("heads", heads),
                        ("kv_heads", kv_heads), ("vocab", vocab_size)):
        if getattr(args, name) is None:
            setattr(args, name, value)
    rng = np.random.default_rng(args.seed)
    tokenizer = padded_vocab(tokenizer_fields(default_model_path()), args.vocab)
    vocab = len(tokenizer["tokenizer.ggml.tokens"][0])
    heavy = args.mix == "q4_k_m"
    head = (q6_k_blocks(rng, vocab, args.hidden, 0.02), Q6_K) if heavy \
        else (q4_k_blocks(rng, vocab, args.hidden, 0.02), Q4_K)
    # Tied: the embedding is the head (Q6_K in Q4_K_M). Untied: llama.cpp keeps the embedding Q4_K.
    embd = head if tied else (q4_k_blocks(rng, vocab, args.hidden, 0.02), Q4_K)
    tensors = {"token_embd.weight": embd,
               "output_norm.weight": (np.ones(args.hidden, np.float32), None)}
    if not tied:
        tensors["output.weight"] = head
    for layer in range(args.layers):
        block = layer_tensors(rng, layer, args)
        if args.draft and layer >= args.draft_layers:
            for name in (f"blk.{layer}.attn_output.weight", f"blk.{layer}.ffn_down.weight"):
                data, kind = block[name]
                block[name] = (scaled(data, kind, args.extra_scale), kind)
        tensors.update(block)
    write_model(args.out, args, args.layers, tensors, tokenizer)
    if args.draft:
        write_model(args.draft, args, args.draft_layers, tensors, tokenizer)


if __name__ == "__main__":
    main()

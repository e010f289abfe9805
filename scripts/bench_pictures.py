"""A picture's cost on the CPU: the vision encoder's time per picture and the time to first token of
a prompt holding one 448 x 448 picture, ours beside HF transformers on the same random weights.

    python scripts/bench_pictures.py [--family llava|qwen2_5_vl|gemma3 ...] [--threads 2] [--reps 3]

Each family is built at a real checkpoint's vision shape with random weights (the time depends on
the shapes, not the values): LLaVA-1.5's CLIP ViT-L/14-336, Qwen2.5-VL-3B's windowed ViT and
Gemma 3 4B's SigLIP-so400m at 896. The language model is a small real shape (Qwen2.5-0.5B's, or
Gemma 3 1B's for Gemma), named in the output, so the time to first token is the picture's encoder
plus the prefill of its placeholder run and the text around it. The picture goes through the
checkpoint's own image processor (transformers, PIL path). fp32 on both sides, one process, medians
of `--reps` runs after a warm-up; the encoder cache is bypassed (each of our runs is a new picture
to the engine: a new content hash, prefix caching off).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time

import numpy as np
import torch

VOCAB = 32000
TEXT = [11, 12, 13, 14, 15, 16, 17, 18]  # words before and after the picture
QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096, rms_norm_eps=1e-6)


def _llava():
    import transformers as tf

    vision = tf.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                 num_attention_heads=16, image_size=336, patch_size=14, hidden_act="quick_gelu",
                                 projection_dim=768)
    text = tf.LlamaConfig(**QWEN_05B)
    cfg = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=VOCAB - 1,
                         image_seq_length=576)
    processor = tf.CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    return tf.LlavaForConditionalGeneration(cfg), processor, "Llama, Qwen2.5-0.5B shape"


def _qwen2_5_vl():
    import transformers as tf

    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=896,
                  patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
                  fullatt_block_indexes=[7, 15, 23, 31])
    # mrope_section scaled to the 0.5B shape's 64-value heads (3B: [16, 24, 24] of 128)
    text = dict(QWEN_05B, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]})
    cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=VOCAB - 1,
                              video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3, vision_end_token_id=VOCAB - 4)
    processor = tf.Qwen2VLImageProcessor()  # the PIL backend where torchvision is absent
    return tf.Qwen2_5_VLForConditionalGeneration(cfg), processor, "Qwen2, Qwen2.5-0.5B shape"


def _gemma3():
    import transformers as tf

    vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                  image_size=896, patch_size=14)
    text = dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                num_key_value_heads=1, head_dim=256, vocab_size=VOCAB, sliding_window=512,
                max_position_embeddings=4096)
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=256,
                          image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3)
    processor = tf.Gemma3ImageProcessor(size={"height": 896, "width": 896})
    return tf.Gemma3ForConditionalGeneration(cfg), processor, "Gemma 3, 1B shape"


FAMILIES = {"llava": _llava, "qwen2_5_vl": _qwen2_5_vl, "gemma3": _gemma3}


def _tokenizer(path: str, image_token: int) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                  unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(path)


def _processed(processor) -> dict:
    """The processor's arrays for one 448 x 448 picture (random pixels)."""
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8))
    out = processor(images=image, return_tensors="np")
    return {k: v for k, v in out.items() if k in ("pixel_values", "image_grid_thw")}


def _median_s(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(family: str, reps: int) -> dict:
    from deepinfer import LLM, SamplingParams
    from deepinfer.contracts.multimodal import PictureInput

    torch.manual_seed(0)
    hf, processor, text_shape = FAMILIES[family]()
    hf = hf.float().eval()
    arrays = _processed(processor)
    image_token = VOCAB - 1
    with torch.inference_mode():
        tensors = {k: torch.as_tensor(v) for k, v in arrays.items()}
        features = hf.model.get_image_features(**tensors)
        features = getattr(features, "pooler_output", features)
        length = sum(f.shape[0] for f in features) if isinstance(features, (list, tuple)) else \
            features.reshape(-1, features.shape[-1]).shape[0]
    ids = TEXT + [image_token] * length + TEXT
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path)
        _tokenizer(path, image_token)
        llm = LLM(path, dtype="float32", max_model_len=4096, max_num_batched_tokens=4096, max_num_seqs=1,
                  enable_prefix_caching=False)
    model = llm.engine.runner.model
    count = iter(range(1 << 30))

    def picture() -> PictureInput:  # a new picture to the engine each time (its encoder cache misses)
        return PictureInput(hashlib.sha256(f"{family}-{next(count)}".encode()).hexdigest(), len(TEXT), length, arrays)

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with torch.inference_mode():
        ours_encoder = _median_s(lambda: model.encode_pictures([picture()]), reps)
        hf_encoder = _median_s(lambda: hf.model.get_image_features(**tensors), reps)
        ours_ttft = _median_s(lambda: llm.generate([{"prompt_token_ids": ids, "pictures": (picture(),)}], params,
                                                   use_tqdm=False), reps)
        hf_ttft = _median_s(lambda: hf(input_ids=torch.tensor([ids]), **tensors, use_cache=False,
                                       logits_to_keep=1).logits.argmax(-1), reps)
    return {"family": family, "language_model": text_shape, "picture": "448x448",
            "placeholder_tokens": length, "prompt_tokens": len(ids), "threads": torch.get_num_threads(),
            "encoder_s": {"ours": round(ours_encoder, 3), "hf": round(hf_encoder, 3),
                          "hf_over_ours": round(hf_encoder / ours_encoder, 2)},
            "ttft_s": {"ours": round(ours_ttft, 3), "hf": round(hf_ttft, 3),
                       "hf_over_ours": round(hf_ttft / ours_ttft, 2)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="+", choices=sorted(FAMILIES), default=sorted(FAMILIES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for family in args.family:
        print(json.dumps(bench(family, args.reps)), flush=True)


if __name__ == "__main__":
    main()

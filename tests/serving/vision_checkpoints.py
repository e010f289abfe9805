"""Tiny processor folders of the vision families (a word-level tokenizer with the picture tokens,
the family's PIL image processor, a config.json naming the model type), built with transformers."""

from __future__ import annotations

import json
import os

from PIL import Image

WORDS = "hello what is in this picture user assistant system the a and".split()
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
                 "{% else %}{% for p in m.content %}{% if p.type == 'image' %}<|vision_start|><|image_pad|>"
                 "<|vision_end|>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAVA_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}{% else %}"
                  "{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}"
                  "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{% if m.content is string %}"
                  "{{ m.content }}{% else %}{% for p in m.content %}{% if p.type == 'image' %}<start_of_image>"
                  "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def tiny_tokenizer(specials: list[str], chat_template: str, **extra):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1}
    for word in WORDS + [chr(c) for c in range(33, 127)]:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>", **extra)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = chat_template
    return tok


ANYRES = ("llava_next", "llava_onevision")
# tiles of 28 pixels: the two pictures below take grids of 2x2 (60x90) and 1x3 (120x56) tiles
ANYRES_PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]


def vision_folder(family: str, path: str):
    """A processor folder of `family` at `path`; returns (tokenizer, image_processor, processor settings)."""
    import transformers as tf

    if family == "qwen2_vl":
        tok = tiny_tokenizer(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>"],
                             QWEN_TEMPLATE)
        ip = tf.Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
        settings = {}
        config = {"model_type": "qwen2_vl", "vision_config": {"patch_size": 14}, "image_token_id":
                  tok.convert_tokens_to_ids("<|image_pad|>")}
    elif family == "llava":
        tok = tiny_tokenizer(["<image>"], LLAVA_TEMPLATE)
        ip = tf.LlavaImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
        settings = {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
                    "image_token": "<image>"}
        config = {"model_type": "llava", "vision_config": {"patch_size": 14},
                  "image_token_index": tok.convert_tokens_to_ids("<image>")}
    elif family in ANYRES:
        tok = tiny_tokenizer(["<image>"], LLAVA_TEMPLATE)
        if family == "llava_next":  # CLIP: a CLS row besides the 2x2 patches of a 28-pixel view
            ip = tf.LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                               image_grid_pinpoints=ANYRES_PINPOINTS)
            settings = {"patch_size": 14, "vision_feature_select_strategy": "default",
                        "num_additional_image_tokens": 1}
        else:  # SigLIP: no CLS; anyres_max_1 scales every grid past one view down
            ip = tf.LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28},
                                                    image_grid_pinpoints=ANYRES_PINPOINTS)
            settings = {"num_image_tokens": 4, "vision_feature_select_strategy": "full",
                        "vision_aspect_ratio": "anyres_max_1"}
        config = {"model_type": family, "vision_config": {"patch_size": 14, "image_size": 28},
                  "image_token_index": tok.convert_tokens_to_ids("<image>")}
    elif family == "gemma3":
        tok = tiny_tokenizer(["<start_of_image>", "<image_soft_token>", "<end_of_image>", "<bos>",
                              "<start_of_turn>", "<end_of_turn>"], GEMMA_TEMPLATE, bos_token="<bos>",
                             extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                   "image_token": "<image_soft_token>"})
        ip = tf.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
        settings = {"image_seq_length": 5}
        config = {"model_type": "gemma3", "vision_config": {"patch_size": 14}, "mm_tokens_per_image": 5}
    else:
        raise ValueError(family)
    os.makedirs(path, exist_ok=True)
    tok.save_pretrained(path)
    ip.save_pretrained(path)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump(settings, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return tok, ip, settings


def two_pictures() -> list[Image.Image]:
    """Two pictures of different sizes and content."""
    a = Image.new("RGB", (60, 90), (10, 20, 30))
    b = Image.linear_gradient("L").resize((120, 56)).convert("RGB")
    return [a, b]

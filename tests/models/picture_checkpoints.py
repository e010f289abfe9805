"""Tiny random checkpoint folders of the vision families, as a user has them: the HF model
(`save_pretrained`, weights drawn wide enough that a picture decides the answer), a tokenizer with a
chat template, and the image processor's `preprocessor_config.json` (`save_pretrained`); and the HF
reference on them (`Checkpoint.hf_answer`: the chat template, the family's HF processor, greedy `generate`).

The tokenizer is byte-level (every token is some characters, the space included, and decoding is
their concatenation), so answers compare exactly as text, a server's streamed detokenization
against HF's `decode` of the whole answer. (Qwen2-VL's HF processor wants a torchvision video
processor in its constructor; it is assembled without one, its image path unchanged, as
tests/serving/test_vision.py does.)
"""

from __future__ import annotations

import base64
import io
import json
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serving"))
from vision_checkpoints import GEMMA_TEMPLATE, LLAVA_TEMPLATE, QWEN_TEMPLATE  # noqa: E402

MAX_TOKENS = 8
QUESTION = "what is in this picture?"
SPECIALS = {
    "llava": ["<image>"],
    "qwen2_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>"],
    "gemma3": ["<start_of_image>", "<image_soft_token>", "<end_of_image>", "<bos>", "<start_of_turn>",
               "<end_of_turn>"],
}
TEMPLATES = {"llava": LLAVA_TEMPLATE, "qwen2_vl": QWEN_TEMPLATE, "gemma3": GEMMA_TEMPLATE}


def byte_tokenizer(specials: list[str], chat_template: str, **extra):
    """A byte-level BPE tokenizer without merges over printable ASCII, space and newline: one token
    per character, decoded exactly (a token's leading space is its own character)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0}
    for byte in [10, *range(32, 127)]:
        vocab.setdefault(_byte_char(byte), len(vocab))
    backend = Tokenizer(models.BPE(vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", clean_up_tokenization_spaces=False,
                                  **extra)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = chat_template
    return tok


def _byte_char(byte: int) -> str:
    """GPT-2's byte-to-character map (the one ByteLevel uses): printable bytes are themselves, the
    others are shifted past 255 in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


# the decoder's weights' spread per family: wide enough that answers are not one token repeated
# and that the pictures decide them (the vision side's is VISION_STD)
TEXT_STD = {"llava": 0.1, "qwen2_vl": 0.1, "qwen2_5_vl": 0.03, "gemma3": 0.03, "llava_next": 0.1,
            "llava_onevision": 0.1}
VISION_STD = 0.1
VISION_PARTS = ("visual.", "vision_tower.", "multi_modal_projector.")


def _widen(model, text_std: float) -> None:
    """Weights drawn wider than the default init: logits far from uniform, pictures decide the answer."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, VISION_STD if any(part in name for part in VISION_PARTS) else text_std)


def _llava(tok):
    import transformers as tf

    text = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          bos_token_id=None, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=56, patch_size=14, projection_dim=32)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids(
        "<image>"), vision_feature_layer=-1, vision_feature_select_strategy="default")
    image_processor = tf.LlavaImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    settings = {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}
    model = tf.LlavaForConditionalGeneration(config)
    processor = tf.LlavaProcessor(image_processor=image_processor, tokenizer=tok, **settings)
    return model, image_processor, {**settings, "image_token": "<image>"}, processor


# anyres tiles of 28 pixels (2x2 patches of 14): two_pictures() take a 3x3 grid (80x60: unpadded to 4x6
# rows, over OneVision's anyres_max_4 bound of 16, so scaled to 3x4) and a 3x3 grid (50x110: 6x2, kept)
ANYRES_PINPOINTS = [[28, 56], [56, 28], [56, 56], [84, 84]]


def _anyres(tok, family: str):
    """A tiny LLaVA-NeXT (CLIP tower, Llama decoder) or LLaVA-OneVision (SigLIP tower, Qwen2 decoder)."""
    import transformers as tf

    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=tok.eos_token_id,
                tie_word_embeddings=False)
    image_token = tok.convert_tokens_to_ids("<image>")
    if family == "llava_next":
        vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=28, patch_size=14, projection_dim=32)
        config = tf.LlavaNextConfig(vision_config=vision, text_config=tf.LlamaConfig(**text),
                                    image_token_index=image_token, image_grid_pinpoints=ANYRES_PINPOINTS)
        image_processor = tf.LlavaNextImageProcessorPil(size={"shortest_edge": 28},
                                                        crop_size={"height": 28, "width": 28},
                                                        image_grid_pinpoints=ANYRES_PINPOINTS)
        settings = {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}
        processor = tf.LlavaNextProcessor(image_processor=image_processor, tokenizer=tok, **settings)
        return tf.LlavaNextForConditionalGeneration(config), image_processor, settings, processor
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=28, patch_size=14, vision_use_head=False)
    config = tf.LlavaOnevisionConfig(vision_config=vision, text_config=tf.Qwen2Config(**text),
                                     image_token_index=image_token, video_token_index=len(tok) - 1,
                                     image_grid_pinpoints=ANYRES_PINPOINTS, vision_aspect_ratio="anyres_max_4")
    image_processor = tf.LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28},
                                                         image_grid_pinpoints=ANYRES_PINPOINTS)
    settings = {"num_image_tokens": 4, "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_4"}
    processor = object.__new__(tf.LlavaOnevisionProcessor)  # its image path, without a torchvision video processor
    processor.image_processor, processor.tokenizer, processor.video_processor = image_processor, tok, None
    processor.chat_template = None
    processor.num_image_tokens = settings["num_image_tokens"]
    processor.vision_feature_select_strategy = settings["vision_feature_select_strategy"]
    processor.vision_aspect_ratio = settings["vision_aspect_ratio"]
    processor.image_token, processor.video_token, processor.video_token_id = "<image>", "<video>", None
    processor.image_token_id = image_token
    return tf.LlavaOnevisionForConditionalGeneration(config), image_processor, settings, processor


def _qwen(tok, kind: str):
    import transformers as tf

    config_cls, model_cls = {"qwen2_vl": (tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration),
                             "qwen2_5_vl": (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration)}[kind]
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None,
                eos_token_id=tok.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = {"qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                               temporal_patch_size=2, spatial_merge_size=2),
              # windows of 56 pixels = 2x2 merged groups; block 1 attends to the whole picture
              "qwen2_5_vl": dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                                 patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
                                 fullatt_block_indexes=[1])}[kind]
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"))}
    config = config_cls(text_config=text, vision_config=vision, video_token_id=len(tok) - 1, tie_word_embeddings=False,
                        **ids)
    image_processor = tf.Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    processor = object.__new__(tf.Qwen2VLProcessor)  # the image path of Qwen2-VL's processor, no video one
    processor.image_processor, processor.tokenizer = image_processor, tok
    processor.video_processor, processor.chat_template = None, None
    processor.image_token, processor.video_token, processor.video_token_id = "<|image_pad|>", "<|video_pad|>", None
    processor.image_token_id = ids["image_token_id"]
    return model_cls(config), image_processor, {}, processor


def _gemma3(tok):
    import transformers as tf

    text = tf.Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=16,
                               layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                               max_position_embeddings=1024, rms_norm_eps=1e-6, final_logit_softcapping=10.0,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0)
    # 56x56 pixels in 7x7 patches: an 8x8 grid avg-pooled to 4x4 = 16 soft tokens a picture
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   image_size=56, patch_size=7, vision_use_head=False)
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=16,
                             image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
                             boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
                             eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"))
    image_processor = tf.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    settings = {"image_seq_length": 16}
    processor = tf.Gemma3Processor(image_processor=image_processor, tokenizer=tok, **settings)
    return tf.Gemma3ForConditionalGeneration(config), image_processor, settings, processor


@dataclass
class Checkpoint:
    """A family's checkpoint folder and its HF reference (the model, its processor)."""

    family: str
    path: str
    tokenizer: object
    model: object
    processor: object

    def hf_answer(self, content: list[dict], images: list, max_tokens: int = MAX_TOKENS) -> tuple[list[int], str]:
        """HF's greedy (token ids, text) for one user message of `content` ({"type": "image"} and text
        parts), `images` its pictures in order."""
        return self.hf_chat([{"role": "user", "content": content}], images, max_tokens)

    def hf_chat(self, messages: list[dict], images: list, max_tokens: int = MAX_TOKENS) -> tuple[list[int], str]:
        """HF's greedy (token ids, text) answering `messages`, `images` their pictures in order."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if images:
            inputs = dict(self.processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False))
        else:
            inputs = dict(self.tokenizer([text], return_tensors="pt", add_special_tokens=False))
        if self.family.startswith("qwen") and images:  # which positions are a picture's, for M-RoPE
            inputs["mm_token_type_ids"] = (inputs["input_ids"] == self.processor.image_token_id).int()
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        answer = out[0, inputs["input_ids"].shape[1]:].tolist()
        return answer, self.tokenizer.decode(answer, skip_special_tokens=True)


def build_checkpoint(family: str, path: str) -> Checkpoint:
    """The family's folder at `path`: tokenizer and chat template, preprocessor_config.json,
    processor settings, the random model's config.json, safetensors and generation config."""
    base = "qwen2_vl" if family.startswith("qwen") else "llava" if family.startswith("llava") else family
    extra = {"bos_token": "<bos>"} if family == "gemma3" else {}
    if family == "gemma3":
        extra["extra_special_tokens"] = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                         "image_token": "<image_soft_token>"}
    tok = byte_tokenizer(SPECIALS[base], TEMPLATES[base], **extra)
    if family == "llava":
        model, image_processor, settings, processor = _llava(tok)
    elif family == "gemma3":
        model, image_processor, settings, processor = _gemma3(tok)
    elif family.startswith("llava"):
        model, image_processor, settings, processor = _anyres(tok, family)
    else:
        model, image_processor, settings, processor = _qwen(tok, family)
    _widen(model, TEXT_STD[family])
    model = model.float().eval()
    # a generation config that names its decoding, as a released checkpoint's does: without one the
    # server's unset fields take FALLBACK_SAMPLING (a repetition penalty of 1.05) and HF's would not
    model.generation_config.do_sample = False
    os.makedirs(path, exist_ok=True)
    tok.save_pretrained(path)
    image_processor.save_pretrained(path)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump(settings, f)
    model.save_pretrained(path)
    return Checkpoint(family, path, tok, model, processor)


def noise(width: int, height: int, seed: int) -> Image.Image:
    """A picture of random pixels."""
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def two_pictures() -> list[Image.Image]:
    """Two pictures of different sizes (Qwen: grids 4x6 and 8x4 patches, 6 and 8 tokens)."""
    return [noise(80, 60, 1), noise(50, 110, 2)]


def png_b64(picture) -> str:
    """The picture as a PNG file, base64 (an API's `data` field)."""
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def data_url(picture) -> str:
    return "data:image/png;base64," + png_b64(picture)

"""LLaVA (CLIP tower + projector + Llama) against HF transformers: greedy tokens with pictures, the
prefix cache keyed by picture content, chunked prefill cutting a picture's run, preemption."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.contracts.multimodal import PictureInput
from deepinfer.sampling_params import SamplingParams

VOCAB, IMAGE_TOKEN = 64, 63
IMAGE_SIZE, PATCH = 56, 14
RUN = (IMAGE_SIZE // PATCH) ** 2  # placeholder tokens per picture ("default": the CLS row dropped)
TEXT_BEFORE, TEXT_AFTER = [1, 5, 9, 13, 17, 21, 25, 29, 33], [4, 8, 12, 16, 20, 24, 28, 32]
PROMPT = TEXT_BEFORE + [IMAGE_TOKEN] * RUN + TEXT_AFTER  # 9 + 16 + 8 = 33 tokens
MAX_TOKENS = 6


def _tokenizer(path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB - 1)}, "<image>": IMAGE_TOKEN}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  extra_special_tokens={"image_token": "<image>"})
    tok.save_pretrained(path)


def _text_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       bos_token_id=1, eos_token_id=2)


def _checkpoint(path, **llava) -> str:
    """A tiny random LLaVA (3 CLIP layers, a 2-layer Llama) saved by transformers, with a tokenizer."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH)
    cfg = LlavaConfig(vision_config=vision, text_config=_text_config(), image_token_index=IMAGE_TOKEN,
                      image_seq_length=RUN, **llava)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # large weights: the picture decides the answer
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.25)
    model.save_pretrained(path)
    _tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def hf_model(llava_dir):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()


def _pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)


def _picture(seed: int, offset: int = len(TEXT_BEFORE), length: int = RUN) -> PictureInput:
    pixels = _pixels(seed)
    return PictureInput(hashlib.sha256(pixels.tobytes()).hexdigest(), offset, length, {"pixel_values": pixels})


@torch.no_grad()
def _hf_greedy(hf_model, ids: list[int], pictures: list[PictureInput], n: int = MAX_TOKENS) -> list[int]:
    """HF's greedy tokens: a full forward (no cache) per token, the pictures' pixel values given."""
    pixels = torch.cat([torch.as_tensor(p.tensors["pixel_values"]) for p in pictures])  # [n, 3, S, S]
    ids = list(ids)
    for _ in range(n):
        logits = hf_model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0, -1]  # [V]
        ids.append(int(logits.argmax()))
    return ids[-n:]


def _llm(path: str, **kwargs):
    from deepinfer import LLM

    options = dict(dtype="float32", block_size=8, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)
    return LLM(path, **{**options, **kwargs})


def _ours(llm, prompts) -> list:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def _tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


def test_pictures_match_hf_and_change_the_answer(llava_dir, hf_model):
    a, b = _picture(1), _picture(2)
    want_a, want_b = _hf_greedy(hf_model, PROMPT, [a]), _hf_greedy(hf_model, PROMPT, [b])
    assert want_a != want_b  # the picture decides the answer: the test can fail
    llm = _llm(llava_dir, enable_prefix_caching=False)
    outs = _ours(llm, [{"prompt_token_ids": PROMPT, "pictures": (a,)}, {"prompt_token_ids": PROMPT, "pictures": (b,)}])
    assert [_tokens(o) for o in outs] == [want_a, want_b]


def test_two_pictures_in_one_prompt(llava_dir, hf_model):
    a, b = _picture(3), _picture(4, offset=len(PROMPT) + 2)
    prompt = PROMPT + [7, 11] + [IMAGE_TOKEN] * RUN + [3]
    want = _hf_greedy(hf_model, prompt, [a, b])
    outs = _ours(_llm(llava_dir, enable_prefix_caching=False), [{"prompt_token_ids": prompt, "pictures": (a, b)}])
    assert _tokens(outs[0]) == want


def test_prefix_cache_keys_pictures(llava_dir, hf_model):
    """A, B, A, B with the same text: each answer is its own picture's; the repeats hit the cache
    past the picture's run, B after A shares only the text block before the picture."""
    a, b = _picture(5), _picture(6)
    want = {"a": _hf_greedy(hf_model, PROMPT, [a]), "b": _hf_greedy(hf_model, PROMPT, [b])}
    assert want["a"] != want["b"]
    llm = _llm(llava_dir)
    cached = []
    for name, picture in (("a", a), ("b", b), ("a", a), ("b", b)):
        out = _ours(llm, [{"prompt_token_ids": PROMPT, "pictures": (picture,)}])[0]
        assert _tokens(out) == want[name], name
        cached.append(out.num_cached_tokens)
    assert cached[0] == 0
    assert cached[1] == 8  # the text block [0, 8) only: the block holding B's run start is not A's
    assert cached[2] >= a.end and cached[3] >= b.end  # the repeats hit past the run
    assert llm.engine.runner.steps.pictures.cache.num_encoded == 2  # each picture encoded once
    # A with another tail: the hit ends inside A's run [9, 25), whose last row comes from the cache
    other = TEXT_BEFORE + [IMAGE_TOKEN] * RUN + [30, 26, 22, 18, 14, 10, 6, 3]
    out = _ours(llm, [{"prompt_token_ids": other, "pictures": (a,)}])[0]
    assert out.num_cached_tokens == 24 and _tokens(out) == _hf_greedy(hf_model, other, [a])
    assert llm.engine.runner.steps.pictures.cache.num_encoded == 2


def test_chunked_prefill_splits_the_run(llava_dir, hf_model):
    """A token budget of 5 cuts each picture's run over several chunks, two requests batched."""
    a, b = _picture(7), _picture(8)
    want = [_hf_greedy(hf_model, PROMPT, [a]), _hf_greedy(hf_model, PROMPT, [b])]
    llm = _llm(llava_dir, max_num_batched_tokens=5, enable_prefix_caching=False)
    outs = _ours(llm, [{"prompt_token_ids": PROMPT, "pictures": (a,)}, {"prompt_token_ids": PROMPT, "pictures": (b,)}])
    assert [_tokens(o) for o in outs] == want
    assert llm.engine.runner.steps.pictures.cache.num_encoded == 2  # once each, over all chunks


def test_preemption_recomputes_pictures(llava_dir, hf_model):
    """Too few blocks for three requests at once: some are preempted and recompute their pictures."""
    prompt = PROMPT + [3, 6, 10]  # 36 tokens: decoding crosses into a sixth block
    pictures = [_picture(s) for s in (9, 10, 11)]
    want = [_hf_greedy(hf_model, prompt, [p]) for p in pictures]
    llm = _llm(llava_dir, num_blocks=10, enable_prefix_caching=False, max_num_batched_tokens=16)
    outs = _ours(llm, [{"prompt_token_ids": prompt, "pictures": (p,)} for p in pictures])
    assert [_tokens(o) for o in outs] == want
    assert llm.engine.get_metrics()["num_preemptions"] > 0


def test_pictures_are_checked(llava_dir):
    llm = _llm(llava_dir)
    bad = PictureInput("x", offset=30, length=RUN)  # past the prompt's end
    with pytest.raises(ValueError, match="pictures"):
        _ours(llm, [{"prompt_token_ids": PROMPT, "pictures": (bad,)}])


def test_saved_cache_keys_pictures(llava_dir, hf_model, tmp_path):
    """The cache directory uses the same keys: a new engine reads A's blocks for A, not for B."""
    a, b = _picture(12), _picture(13)
    _ours(_llm(llava_dir, kv_cache_dir=str(tmp_path / "kv")), [{"prompt_token_ids": PROMPT, "pictures": (a,)}])
    llm = _llm(llava_dir, kv_cache_dir=str(tmp_path / "kv"))
    out_b = _ours(llm, [{"prompt_token_ids": PROMPT, "pictures": (b,)}])[0]
    out_a = _ours(llm, [{"prompt_token_ids": PROMPT, "pictures": (a,)}])[0]
    assert out_b.num_cached_tokens == 8 and out_a.num_cached_tokens >= a.end
    assert _tokens(out_a) == _hf_greedy(hf_model, PROMPT, [a]) and _tokens(out_b) == _hf_greedy(hf_model, PROMPT, [b])


def test_feature_layers_list_and_full_strategy(tmp_path):
    """vision_feature_layer as a list (hidden states concatenated), "full" keeps the CLS row."""
    from transformers import LlavaForConditionalGeneration

    path = _checkpoint(tmp_path / "llava", vision_feature_layer=[0, -1], vision_feature_select_strategy="full")
    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    prompt = TEXT_BEFORE + [IMAGE_TOKEN] * (RUN + 1) + TEXT_AFTER
    a = _picture(14, length=RUN + 1)
    out = _ours(_llm(path, enable_prefix_caching=False), [{"prompt_token_ids": prompt, "pictures": (a,)}])[0]
    assert _tokens(out) == _hf_greedy(hf, prompt, [a])


def test_a_text_model_refuses_pictures(tmp_path):
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(_text_config()).save_pretrained(tmp_path)
    llm = _llm(str(tmp_path))
    with pytest.raises(ValueError, match="pictures.*'llama'"):
        _ours(llm, [{"prompt_token_ids": PROMPT, "pictures": (_picture(1),)}])


def test_field_defaults_are_transformers():
    from transformers import CLIPVisionConfig, LlavaConfig

    from deepinfer.model_executor.models.llava import ClipVisionFields, LlavaConfigFields

    for ours, theirs in ((LlavaConfigFields(), LlavaConfig()), (ClipVisionFields(), CLIPVisionConfig())):
        names = set(type(ours).__dataclass_fields__) - set(HFConfigFields.__dataclass_fields__)
        assert {n: getattr(ours, n) for n in names} == {n: getattr(theirs, n) for n in names}


def test_processor_pictures_of_two_sizes(llava_dir, hf_model):
    """Pictures of different sizes through transformers' CLIP processor (resize, crop, normalise)."""
    from PIL import Image
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE,
                                                                                   "width": IMAGE_SIZE})
    rng = np.random.default_rng(20)
    pictures = []
    for size in ((80, 60), (40, 90)):
        image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
        pixels = processor(images=image, return_tensors="np")["pixel_values"]  # [1, 3, S, S]
        pictures.append(PictureInput(hashlib.sha256(image.tobytes()).hexdigest(), len(TEXT_BEFORE), RUN,
                                     {"pixel_values": pixels}))
    outs = _ours(_llm(llava_dir), [{"prompt_token_ids": PROMPT, "pictures": (p,)} for p in pictures])
    assert [_tokens(o) for o in outs] == [_hf_greedy(hf_model, PROMPT, [p]) for p in pictures]


def test_both_checkpoint_layouts_load():
    from deepinfer.model_executor.models.llava import _renamed

    assert _renamed("model.language_model.norm.weight") == "language_model.model.norm.weight"
    assert _renamed("lm_head.weight") == "language_model.lm_head.weight"
    assert _renamed("model.vision_tower.pre_layrnorm.bias") == "vision_tower.pre_layrnorm.bias"
    assert _renamed("language_model.model.norm.weight") == "language_model.model.norm.weight"

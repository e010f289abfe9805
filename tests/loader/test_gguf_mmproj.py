"""GGUF language models with llama.cpp's vision file (`--mmproj`): loader/gguf_mmproj.py and
loader/mmproj_source.py against HF transformers.

No real mmproj file is used: tests/mmproj_writer.py writes one from a tiny random HF model's vision
tower as llama.cpp's converters do (its docstring lists which converter behaviour it reproduces),
and tests/llamacpp_writer.py writes the language part as a text GGUF. Checks: picture rows of the
mmproj-loaded tower = HF's `get_image_features` (F32 file: 1e-5; F16 / Q8_0: within their
rounding), greedy tokens of text GGUF + mmproj = HF's, and one line for each broken file.
"""

from __future__ import annotations

import hashlib

import gguf
import pytest
import torch
from llamacpp_writer import write_gguf
from mmproj_writer import text_state_dict, write_gemma3_mmproj, write_llava_mmproj, write_qwen_vl_mmproj

from deepinfer.contracts.multimodal import PictureInput
from deepinfer.model_executor.loader import load_model_source
from deepinfer.model_executor.loader.gguf_mmproj import MmprojError, read_mmproj
from deepinfer.model_executor.loader.mmproj_source import attach_mmproj
from deepinfer.model_executor.model_loader import build_model

VOCAB = 64
BOI, SOFT, EOI = 60, 61, 62  # Gemma 3's picture tokens in the tiny vocabulary
GEMMA_RUN, GEMMA_SIZE = 16, 56


def _big_weights(model) -> None:
    """Larger than the default init: logits far from uniform, so pictures decide the answer."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)


# ---- Gemma 3 ------------------------------------------------------------------------------------
def _gemma3_hf():
    import transformers as tf

    text = tf.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=32,
                               max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                               pad_token_id=2)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   image_size=GEMMA_SIZE, patch_size=7, vision_use_head=False, layer_norm_eps=1e-6)
    cfg = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=GEMMA_RUN,
                          image_token_index=SOFT, boi_token_index=BOI, eoi_token_index=EOI)
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    _big_weights(model)
    return model


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(text GGUF path, {qtype: mmproj path}, HF model)."""
    hf = _gemma3_hf()
    root = tmp_path_factory.mktemp("gemma3-mmproj")
    text = write_gguf(root / "text.gguf", "gemma3", hf.config.text_config, text_state_dict(hf),
                      control_tokens={BOI: "<start_of_image>", SOFT: "<image_soft_token>", EOI: "<end_of_image>"},
                      extra={"gemma3.attention.sliding_window_pattern": (2, gguf.GGUFValueType.UINT32)})
    files = {q: write_gemma3_mmproj(root / f"mmproj-{q}.gguf", hf, q) for q in ("f32", "f16", "q8_0")}
    return text, files, hf


def _gemma3_model(text: str, mmproj: str):
    source = attach_mmproj(load_model_source(text), mmproj)
    return source, build_model(source, torch.float32, torch.device("cpu"), 256)


def _gemma_pixels(seed: int) -> torch.Tensor:
    return torch.randn(1, 3, GEMMA_SIZE, GEMMA_SIZE, generator=torch.Generator().manual_seed(seed))  # [1, 3, S, S]


def _picture(tensors: dict, offset: int, length: int) -> PictureInput:
    digest = hashlib.sha256(next(iter(tensors.values())).numpy().tobytes()).hexdigest()
    return PictureInput(digest, offset, length, tensors)


ROUNDING = {"f16": 5e-3, "q8_0": 3e-2}  # the largest difference allowed, relative to the largest value


def _assert_rows_close(got: torch.Tensor, ref: torch.Tensor, qtype: str) -> None:
    """F32 file: HF's rows within 1e-5; F16 / Q8_0: within the file's rounding (relative to the rows'
    scale), and not equal (the rounding is really there)."""
    if qtype == "f32":
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        return
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert 0 < err <= ROUNDING[qtype] * scale, (err, scale)


def test_gemma3_config_and_class(gemma3):
    """The composite config the loader builds: SigLIP sizes, soft tokens per picture, placeholder ids."""
    source, model = _gemma3_model(gemma3[0], gemma3[1]["f32"])
    cfg = source.hf_config
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert cfg.model_type == "gemma3" and cfg.mm_tokens_per_image == GEMMA_RUN
    assert (cfg.image_token_index, cfg.boi_token_index, cfg.eoi_token_index) == (SOFT, BOI, EOI)
    v = cfg.vision_config
    assert (v.hidden_size, v.intermediate_size, v.num_hidden_layers, v.image_size, v.patch_size) == (32, 64, 2, 56, 7)
    assert cfg.vocab_size == VOCAB and source.vision["picture"]["image_seq_length"] == GEMMA_RUN
    assert source.identity != load_model_source(gemma3[0]).identity  # the vision file is part of the model


@pytest.mark.parametrize("qtype", ["f32", "f16", "q8_0"])
def test_gemma3_picture_rows_match_transformers(gemma3, qtype):
    """encode_pictures of the mmproj-loaded tower = HF get_image_features (F16 / Q8_0: within rounding)."""
    _, model = _gemma3_model(gemma3[0], gemma3[1][qtype])
    pixels = torch.cat([_gemma_pixels(1), _gemma_pixels(2)])  # [2, 3, S, S]
    pictures = [_picture({"pixel_values": pixels[i:i + 1]}, 3 + 20 * i, GEMMA_RUN) for i in range(2)]
    with torch.no_grad():
        got = torch.stack(model.encode_pictures(pictures))  # [2, m, hidden]
        ref = gemma3[2].get_image_features(pixels).pooler_output
    _assert_rows_close(got, ref, qtype)


def test_gemma3_greedy_tokens_match_transformers(gemma3):
    """Text GGUF + mmproj through LLM: greedy tokens = HF's (runs bidirectional, as HF with token_type_ids)."""
    from deepinfer import LLM, SamplingParams

    hf = gemma3[2]
    llm = LLM(gemma3[0], mmproj=gemma3[1]["f32"], num_blocks=32, block_size=8, max_model_len=128,
              max_num_seqs=2, quantization="none")
    pixels = _gemma_pixels(3)
    ids = [1, 5, 9, BOI] + [SOFT] * GEMMA_RUN + [EOI, 11, 13]
    picture = _picture({"pixel_values": pixels}, 4, GEMMA_RUN)
    out = llm.generate([{"prompt_token_ids": ids, "pictures": [picture]}], SamplingParams(max_tokens=6, temperature=0))
    seq = list(ids)
    with torch.no_grad():
        for _ in range(6):
            input_ids = torch.tensor([seq])
            types = (input_ids == SOFT).long()
            logits = hf(input_ids=input_ids, pixel_values=pixels, token_type_ids=types, use_cache=False).logits
            seq.append(int(logits[0, -1].argmax()))
    assert list(out[0].outputs[0].token_ids) == seq[len(ids):]
    other = llm.generate([{"prompt_token_ids": ids, "pictures": [_picture({"pixel_values": _gemma_pixels(4)}, 4,
                                                                          GEMMA_RUN)]}],
                         SamplingParams(max_tokens=6, temperature=0))
    assert list(other[0].outputs[0].token_ids) != seq[len(ids):]  # the picture decides the answer


def test_quantized_text_gguf_stays_quantized_beside_the_tower(gemma3, tmp_path):
    """A Q8_0 text GGUF with quantization auto: its matrices stay packed (QuantLinear) while the vision
    tower loads as floats, its rows still HF's."""
    from deepinfer import LLM
    from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa
    from deepinfer.model_executor.layers.quant_linear import QuantLinear

    if not kernel_isa():
        pytest.skip("no quantized CPU kernels here (no C++ compiler, or DEEPINFER_CPU_ISA=none): a GGUF's matrices "
                    "are dequantized at load, so there is nothing packed to check")
    hf = gemma3[2]
    text = write_gguf(tmp_path / "text-q8.gguf", "gemma3", hf.config.text_config, text_state_dict(hf),
                      qtype=gguf.GGMLQuantizationType.Q8_0,
                      control_tokens={BOI: "<start_of_image>", SOFT: "<image_soft_token>", EOI: "<end_of_image>"},
                      extra={"gemma3.attention.sliding_window_pattern": (2, gguf.GGUFValueType.UINT32)})
    llm = LLM(text, mmproj=gemma3[1]["f32"], num_blocks=32, block_size=8, max_model_len=128, max_num_seqs=2)
    model = llm.engine.runner.model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert model.vision_tower.embeddings.patch_embedding.weight.dtype == torch.float32
    pixels = _gemma_pixels(7)
    with torch.no_grad():
        got = model.encode_pictures([_picture({"pixel_values": pixels}, 4, GEMMA_RUN)])[0]
        ref = hf.get_image_features(pixels).pooler_output[0]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


PICTURE_TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<start_of_image>"
                    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")


def test_gemma3_chat_preprocesses_from_the_mmproj_keys(gemma3):
    """LLM.chat with a picture: no preprocessor_config.json beside a GGUF, so the image processor is
    built from the mmproj's keys (size, mean, std); the marker becomes <start_of_image>, 16 soft tokens,
    <end_of_image>; the pixels equal transformers' Gemma 3 processor set as the checkpoint's would be,
    and the greedy tokens equal HF's on those ids and pixels."""
    import numpy as np
    from PIL import Image
    from transformers import Gemma3ImageProcessorPil

    from deepinfer import LLM, SamplingParams

    text, files, hf = gemma3
    llm = LLM(text, mmproj=files["f32"], chat_template=PICTURE_TEMPLATE, num_blocks=32, block_size=8,
              max_model_len=128, max_num_seqs=2, quantization="none")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=np.uint8))
    message = {"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "image", "image": image},
                                           {"type": "text", "text": "ba"}]}
    out = llm.chat([message], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    ids = list(out.prompt_token_ids)
    start = ids.index(SOFT)
    assert ids.count(SOFT) == GEMMA_RUN and ids[start:start + GEMMA_RUN] == [SOFT] * GEMMA_RUN
    assert ids[start - 1] == BOI and ids[start + GEMMA_RUN] == EOI
    reference = Gemma3ImageProcessorPil(size={"height": GEMMA_SIZE, "width": GEMMA_SIZE}, image_mean=[0.5] * 3,
                                        image_std=[0.5] * 3)
    pixels = torch.as_tensor(reference(images=[image], return_tensors="np")["pixel_values"])  # [1, 3, S, S]
    seq = list(ids)
    with torch.no_grad():
        for _ in range(6):
            input_ids = torch.tensor([seq])
            logits = hf(input_ids=input_ids, pixel_values=pixels, token_type_ids=(input_ids == SOFT).long(),
                        use_cache=False).logits
            seq.append(int(logits[0, -1].argmax()))
    assert list(out.outputs[0].token_ids) == seq[len(ids):]


# ---- Qwen2-VL / Qwen2.5-VL ----------------------------------------------------------------------
def _sections(hf) -> list[int]:
    return [*hf.config.text_config.rope_parameters["mrope_section"], 0]  # the converter pads to 4


@pytest.fixture(scope="module", params=("qwen2_5_vl", "qwen2_vl"))
def qwen(request, tmp_path_factory):
    """(text GGUF path, {qtype: mmproj path}, HF model) of a tiny Qwen2.5-VL / Qwen2-VL."""
    import qwen_vl_models as q

    hf = q.hf_model(request.param)
    root = tmp_path_factory.mktemp(request.param + "-mmproj")
    names = {q.IMAGE: "<|image_pad|>", q.VIDEO: "<|video_pad|>", q.START: "<|vision_start|>", q.END: "<|vision_end|>"}
    text = write_gguf(root / "text.gguf", "qwen2vl", hf.config.text_config, text_state_dict(hf), control_tokens=names,
                      extra={"qwen2vl.rope.dimension_sections": (_sections(hf), gguf.GGUFValueType.ARRAY)})
    files = {qtype: write_qwen_vl_mmproj(root / f"mmproj-{qtype}.gguf", hf, qtype) for qtype in ("f32", "f16")}
    return text, files, hf


@pytest.mark.parametrize("qtype", ["f32", "f16"])
def test_qwen_picture_rows_match_transformers(qwen, qtype):
    """The mmproj's split q/k/v and Conv3d halves put back: encode_pictures = HF get_image_features."""
    import qwen_vl_models as q

    text, files, hf = qwen
    source = attach_mmproj(load_model_source(text), files[qtype])
    model = build_model(source, torch.float32, torch.device("cpu"), 256)
    assert source.hf_config.model_type == hf.config.model_type
    assert source.hf_config.image_token_id == q.IMAGE
    pics = q.pictures()
    inputs = q.hf_inputs(q.prompt_ids(pics), pics)
    with torch.no_grad():
        ref = hf.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
        got = model.encode_pictures(pics)
    assert [tuple(g.shape) for g in got] == [tuple(r.shape) for r in ref]
    _assert_rows_close(torch.cat(got), torch.cat(list(ref)), qtype)


def test_qwen_greedy_tokens_match_transformers(qwen):
    """Text GGUF (arch qwen2vl: M-RoPE sections in its keys) + mmproj: greedy tokens = HF generate."""
    import qwen_vl_models as q

    from deepinfer import LLM, SamplingParams

    text, files, hf = qwen
    llm = LLM(text, mmproj=files["f32"], dtype="float32", block_size=8, num_blocks=64, max_num_seqs=4,
              max_model_len=128, quantization="none")
    pics = q.pictures()
    ids = q.prompt_ids(pics)
    out = llm.generate([{"prompt_token_ids": ids, "pictures": tuple(pics)}],
                       SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        ref = hf.generate(**q.hf_inputs(ids, pics), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    assert list(out[0].outputs[0].token_ids) == ref


QWEN_TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                 "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
                 "{% endfor %}")


def test_qwen_chat_preprocesses_from_the_mmproj_keys(qwen):
    """LLM.chat with a picture: the Qwen2-VL image processor from the mmproj's patch / merge size, mean
    and std (patches and grid as transformers' processor gives them), one <|image_pad|> per merged
    patch group, greedy tokens = HF generate on those ids and arrays (M-RoPE from the grid)."""
    import numpy as np
    import qwen_vl_models as q
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    from deepinfer import LLM, SamplingParams

    text, files, hf = qwen
    llm = LLM(text, mmproj=files["f32"], chat_template=QWEN_TEMPLATE, dtype="float32", block_size=8, num_blocks=64,
              max_num_seqs=2, max_model_len=128, quantization="none")
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 30, 3), dtype=np.uint8))
    message = {"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "image", "image": image},
                                           {"type": "text", "text": "ba"}]}
    out = llm.chat([message], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    ids = list(out.prompt_token_ids)
    reference = Qwen2VLImageProcessorPil(patch_size=q.PATCH, merge_size=2, temporal_patch_size=q.TEMPORAL,
                                         image_mean=[0.5] * 3, image_std=[0.5] * 3)
    arrays = reference(images=[image], return_tensors="np")
    run = int(np.prod(arrays["image_grid_thw"][0])) // 4
    start = ids.index(q.IMAGE)
    assert ids.count(q.IMAGE) == run and ids[start:start + run] == [q.IMAGE] * run
    assert ids[start - 1] == q.START and ids[start + run] == q.END
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        ref = hf.generate(input_ids=input_ids, mm_token_type_ids=(input_ids == q.IMAGE).int(),
                          pixel_values=torch.as_tensor(arrays["pixel_values"]),
                          image_grid_thw=torch.as_tensor(arrays["image_grid_thw"]), max_new_tokens=6,
                          do_sample=False)[0, len(ids):].tolist()
    assert list(out.outputs[0].token_ids) == ref


def test_qwen_text_gguf_alone_is_a_text_model(qwen):
    """The qwen2vl text GGUF without --mmproj: a Qwen2 text model (M-RoPE is plain RoPE for text),
    greedy tokens = HF's on a text-only prompt."""
    from deepinfer import LLM, SamplingParams

    text, _, hf = qwen
    llm = LLM(text, dtype="float32", block_size=8, num_blocks=32, max_num_seqs=2, max_model_len=128,
              quantization="none")
    assert llm.engine.source.hf_config.model_type == "qwen2" and llm.engine.source.vision is None
    ids = list(range(5, 30))
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    assert list(out[0].outputs[0].token_ids) == ref


# ---- LLaVA-1.5 ----------------------------------------------------------------------------------
LLAVA_IMAGE, LLAVA_SIZE, LLAVA_PATCH = 63, 56, 14
LLAVA_RUN = (LLAVA_SIZE // LLAVA_PATCH) ** 2


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """(text GGUF path (arch llama: q/k rows permuted), {qtype: mmproj path}, HF model)."""
    import transformers as tf

    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 image_size=LLAVA_SIZE, patch_size=LLAVA_PATCH)
    text_cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                              bos_token_id=1, eos_token_id=2, pad_token_id=2)
    cfg = tf.LlavaConfig(vision_config=vision, text_config=text_cfg, image_token_index=LLAVA_IMAGE,
                         image_seq_length=LLAVA_RUN)
    torch.manual_seed(0)
    hf = tf.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.25)
    root = tmp_path_factory.mktemp("llava-mmproj")
    text = write_gguf(root / "text.gguf", "llama", hf.config.text_config, text_state_dict(hf),
                      control_tokens={LLAVA_IMAGE: "<image>"})
    files = {qtype: write_llava_mmproj(root / f"mmproj-{qtype}.gguf", hf, qtype) for qtype in ("f32", "f16")}
    return text, files, hf


@pytest.mark.parametrize("qtype", ["f32", "f16"])
def test_llava_picture_rows_match_transformers(llava, qtype):
    """The legacy converter's file (last layer dropped, fc1/fc2 names swapped, mm.0 / mm.2) read back:
    encode_pictures = HF get_image_features (feature layer -2, CLS row dropped)."""
    text, files, hf = llava
    source = attach_mmproj(load_model_source(text), files[qtype])
    model = build_model(source, torch.float32, torch.device("cpu"), 256)
    assert type(model).__name__ == "LlavaForConditionalGeneration" and source.hf_config.image_token_index == 63
    pixels = torch.randn(2, 3, LLAVA_SIZE, LLAVA_SIZE, generator=torch.Generator().manual_seed(5))
    pictures = [_picture({"pixel_values": pixels[i:i + 1]}, 3 + 20 * i, LLAVA_RUN) for i in range(2)]
    with torch.no_grad():
        got = torch.stack(model.encode_pictures(pictures))  # [2, N, hidden]
        ref = hf.model.get_image_features(pixel_values=pixels, vision_feature_layer=-2,
                                          vision_feature_select_strategy="default").pooler_output
    _assert_rows_close(got, torch.stack(list(ref)) if isinstance(ref, (list, tuple)) else ref, qtype)


def test_llava_greedy_tokens_match_transformers(llava):
    from deepinfer import LLM, SamplingParams

    text, files, hf = llava
    llm = LLM(text, mmproj=files["f32"], dtype="float32", block_size=8, num_blocks=32, max_num_seqs=2,
              max_model_len=128, quantization="none")
    pixels = torch.randn(1, 3, LLAVA_SIZE, LLAVA_SIZE, generator=torch.Generator().manual_seed(6))
    ids = [1, 5, 9, 13] + [LLAVA_IMAGE] * LLAVA_RUN + [4, 8, 12]
    picture = _picture({"pixel_values": pixels}, 4, LLAVA_RUN)
    out = llm.generate([{"prompt_token_ids": ids, "pictures": [picture]}],
                       SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(hf(input_ids=torch.tensor([seq]), pixel_values=pixels).logits[0, -1].argmax()))
    assert list(out[0].outputs[0].token_ids) == seq[len(ids):]


def test_llava_chat_preprocesses_from_the_mmproj_keys(llava):
    """LLM.chat with a picture: CLIP's processor (shortest side to image_size, center crop) from the
    mmproj's keys, one <image> per patch (the CLS row dropped), greedy tokens = HF's."""
    import numpy as np
    from PIL import Image
    from transformers import CLIPImageProcessorPil

    from deepinfer import LLM, SamplingParams

    text, files, hf = llava
    template = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
                "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")
    llm = LLM(text, mmproj=files["f32"], chat_template=template, dtype="float32", block_size=8, num_blocks=32,
              max_num_seqs=2, max_model_len=128, quantization="none")
    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (70, 90, 3), dtype=np.uint8))
    message = {"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "image", "image": image}]}
    out = llm.chat([message], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    ids = list(out.prompt_token_ids)
    start = ids.index(LLAVA_IMAGE)
    assert ids.count(LLAVA_IMAGE) == LLAVA_RUN and ids[start:start + LLAVA_RUN] == [LLAVA_IMAGE] * LLAVA_RUN
    reference = CLIPImageProcessorPil(size={"shortest_edge": LLAVA_SIZE},
                                      crop_size={"height": LLAVA_SIZE, "width": LLAVA_SIZE},
                                      image_mean=[0.5] * 3, image_std=[0.5] * 3)
    pixels = torch.as_tensor(reference(images=[image], return_tensors="np")["pixel_values"])  # [1, 3, S, S]
    seq = list(ids)
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(hf(input_ids=torch.tensor([seq]), pixel_values=pixels).logits[0, -1].argmax()))
    assert list(out.outputs[0].token_ids) == seq[len(ids):]


# ---- broken files -------------------------------------------------------------------------------
@pytest.mark.parametrize("edit,message", [
    (dict(skip_keys=("clip.vision.block_count",)), "metadata key 'clip.vision.block_count' is missing"),
    (dict(overrides={"clip.projector_type": ("resampler", gguf.GGUFValueType.STRING)}),
     "clip.projector_type 'resampler' is not supported"),
    (dict(skip_tensors=("v.blk.1.attn_k.weight",)), "tensor 'v.blk.1.attn_k.weight' is missing"),
    (dict(overrides={"clip.vision.embedding_length": (48, gguf.GGUFValueType.UINT32)}), "has shape"),
], ids=["missing-key", "unknown-projector", "missing-tensor", "wrong-shape"])
def test_broken_mmproj_is_one_line(gemma3, tmp_path, edit, message):
    path = write_gemma3_mmproj(tmp_path / "broken.gguf", gemma3[2], "f32", **edit)
    with pytest.raises(MmprojError) as info:
        read_mmproj(path)
    text = str(info.value)
    assert message in text and path in text and "\n" not in text


def test_text_file_as_mmproj_is_refused(gemma3):
    with pytest.raises(MmprojError, match=r"general.architecture is 'gemma3', not 'clip'") as info:
        read_mmproj(gemma3[0])
    assert "\n" not in str(info.value)


def test_llava_next_file_is_refused(llava, tmp_path):
    """LLaVA-NeXT's tiles (clip.vision.image_grid_pinpoints) are not LLaVA-1.5: one line naming the key."""
    path = write_llava_mmproj(tmp_path / "next.gguf", llava[2], "f32", overrides={
        "clip.vision.image_grid_pinpoints": ([336, 672, 672, 336], gguf.GGUFValueType.ARRAY)})
    with pytest.raises(MmprojError, match=r"'clip.vision.image_grid_pinpoints' is set \(LLaVA-NeXT\)") as info:
        read_mmproj(path)
    assert path in str(info.value) and "\n" not in str(info.value)


def test_mmproj_of_another_family_is_refused(gemma3, llava):
    """A Gemma 3 vision file beside a Llama text GGUF: one line naming both."""
    with pytest.raises(MmprojError, match=r"projector 'gemma3' goes with a gemma3_text language model") as info:
        attach_mmproj(load_model_source(llava[0]), gemma3[1]["f32"])
    assert "\n" not in str(info.value)


def test_mmproj_flag_and_option():
    """`--mmproj FILE` is an engine flag (and LLM keyword); with tensor parallelism it is refused."""
    import argparse

    from deepinfer.config import EngineConfig
    from deepinfer.engine_args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--mmproj", "vision.gguf"]))
    assert args.mmproj == "vision.gguf" and args.create_engine_config().mmproj == "vision.gguf"
    assert "mmproj" in parser.format_help()
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        EngineConfig(mmproj="vision.gguf", tensor_parallel_size=2)


def test_mmproj_beside_an_hf_checkpoint_is_refused(gemma3):
    """An HF checkpoint has its own vision tower: --mmproj goes with a .gguf language model only."""
    from deepinfer.model_executor.loader.model_source import ModelSource

    source = ModelSource(path="/models/llava-hf", format="hf", hf_config=None, tokenizer=None, identity="x")
    with pytest.raises(MmprojError, match=r"--mmproj goes with a .gguf language model; '/models/llava-hf' is a hf"):
        attach_mmproj(source, gemma3[1]["f32"])

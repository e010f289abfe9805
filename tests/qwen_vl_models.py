"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints, their pictures and prompts, and a one-request
step loop through our cache (for the model-level parity tests of tests/models/test_qwen2_vl.py)."""

from __future__ import annotations

import torch

from deepinfer.contracts.multimodal import PictureInput

VOCAB, IMAGE, VIDEO, START, END = 128, 120, 121, 122, 123
PATCH, TEMPORAL = 4, 2
PIXEL_WIDTH = 3 * TEMPORAL * PATCH * PATCH
GRIDS = ((1, 4, 6), (1, 8, 6))  # two pictures of different sizes: 6 and 12 tokens after the 2x2 merge

_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
_VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=PATCH,
                     temporal_patch_size=TEMPORAL, spatial_merge_size=2),
    # windows of 16 pixels = 2x2 merged groups; block 1 attends to the whole picture
    "qwen2_5_vl": dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                       patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=2, window_size=16,
                       fullatt_block_indexes=[1]),
}


def hf_model(kind: str, seed: int = 0, tie_word_embeddings: bool = False):
    """A random HF model of `kind` ("qwen2_vl", "qwen2_5_vl"), weights wide enough that pictures
    change the greedy tokens."""
    import transformers as tf

    config_cls, model_cls = {"qwen2_vl": (tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration),
                             "qwen2_5_vl": (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration)}[kind]
    cfg = config_cls(text_config=dict(_TEXT), vision_config=dict(_VISION[kind]), image_token_id=IMAGE,
                     video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                     tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    return model


def pictures(seed: int = 0, offsets=(4, 13)) -> list[PictureInput]:
    """Two pictures (GRIDS) whose runs start at `offsets`, random pixels (numpy, as a processor gives)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for offset, (t, h, w) in zip(offsets, GRIDS, strict=True):
        pixels = torch.randn(t * h * w, PIXEL_WIDTH, generator=gen)
        out.append(PictureInput(f"pic{seed}-{offset}", offset, t * h * w // 4,
                                {"pixel_values": pixels.numpy(), "image_grid_thw": torch.tensor([[t, h, w]]).numpy()}))
    return out


def prompt_ids(pics: list[PictureInput], length: int = 34) -> list[int]:
    """Text ids with each picture's run of IMAGE placeholders between START and END."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 100, (length,), generator=gen).tolist()
    for p in pics:
        ids[p.offset - 1], ids[p.end] = START, END
        ids[p.offset:p.end] = [IMAGE] * p.length
    return ids


def hf_inputs(ids: list[int], pics: list[PictureInput]) -> dict:
    """The keyword inputs of HF's forward / generate for one prompt."""
    input_ids = torch.tensor([ids])
    return dict(input_ids=input_ids, mm_token_type_ids=(input_ids == IMAGE).int(),
                pixel_values=torch.cat([torch.as_tensor(p.tensors["pixel_values"]) for p in pics]),
                image_grid_thw=torch.cat([torch.as_tensor(p.tensors["image_grid_thw"]) for p in pics]))


class CachedRequest:
    """One request run step by step through our model and a paged cache of its own."""

    def __init__(self, model, pics: list[PictureInput], block_size: int = 16, num_blocks: int = 8):
        from deepinfer.contracts.model import BoundCaches
        from deepinfer.environ import read_environ
        from deepinfer.model_executor.layers.attention.triton_backend import make_attention_backend
        from deepinfer.worker.cache_engine import CacheEngine
        from deepinfer.worker.cache_sizing import plan_model_cache
        from deepinfer.worker.input_batch import group_addressing

        cpu = torch.device("cpu")
        groups, codecs, _ = plan_model_cache(model, torch.float32, "auto", block_size, read_environ({}), 0)
        cache = CacheEngine(groups, [num_blocks] * len(groups), codecs, cpu)
        model.bind_caches(BoundCaches(groups, [cache.group_caches(i) for i in range(len(groups))], 0,
                                      make_attention_backend("torch", cpu, False)))
        self.model, self.pics, self.cache = model, pics, cache
        self.addressing, self.table = group_addressing(groups), list(range(num_blocks))
        self.embeds = model.encode_pictures(pics)

    @torch.inference_mode()
    def step(self, ids: list[int], start: int) -> torch.Tensor:
        """Logits [len(ids), V] of token indices start .. start+len(ids)-1."""
        from deepinfer.contracts.plan import ScheduledRequest, StepPlan
        from deepinfer.model_executor.forward_context import forward_context
        from deepinfer.worker.input_batch import build_step_inputs
        from deepinfer.worker.rope_positions import rope_kwargs

        s = ScheduledRequest("r", ids, start, (self.table,))
        s.pictures = tuple(self.pics)  # every step carries all of the request's pictures
        inputs = build_step_inputs(StepPlan([s]), self.addressing, torch.device("cpu"))
        with forward_context(inputs.attn_metadata):
            hidden = self.model(inputs.input_ids, inputs.positions, picture_rows=self.picture_rows(start, len(ids)),
                                **rope_kwargs(self.model, inputs.spans, inputs.positions.device))  # [n, hidden]
        return self.model.compute_logits(hidden)  # [n, V]

    def picture_rows(self, start: int, count: int):
        """(rows [P], embeds [P, hidden]) of the step's placeholder tokens, or None."""
        rows, embeds = [], []
        for p, e in zip(self.pics, self.embeds, strict=True):
            lo, hi = max(start, p.offset), min(start + count, p.end)
            if lo < hi:
                rows.append(torch.arange(lo, hi) - start)
                embeds.append(e[lo - p.offset:hi - p.offset])
        return (torch.cat(rows), torch.cat(embeds)) if rows else None

    def greedy(self, ids: list[int], max_tokens: int, chunk: int) -> list[int]:
        """Prefill in chunks of `chunk` tokens, then `max_tokens` greedy tokens one step each."""
        for start in range(0, len(ids), chunk):
            logits = self.step(ids[start:start + chunk], start)
        out = [int(logits[-1].argmax())]
        while len(out) < max_tokens:
            out.append(int(self.step([out[-1]], len(ids) + len(out) - 1)[-1].argmax()))
        return out

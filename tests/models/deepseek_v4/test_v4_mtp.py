"""DeepSeek-V4 MTP draft module against a reference composed from transformers' own modules (fp32).

transformers has no MTP, so the reference is built here from its V4 pieces in the MTP structure
(DeepSeek's `MTPBlock`, vLLM's `DeepSeekV4MultiTokenPredictorLayer`)::

    e = embed(token_{t+1}), zero at position 0;   x = h_proj(hnorm(h)) + e_proj(enorm(e))[:, None]
    x = DeepseekV4DecoderLayer (sliding attention, score-routed MoE);   logits = head(norm(hc_head(x)))

with random weights. The reference's weights are written under DeepSeek-V4 checkpoint names
(`mtp.{i}.*`, e_proj / h_proj as FP8 with a block scale) by a table kept here, and loaded into ours
through `DeepseekV4MTP.load_weights`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.model_executor.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer.model_executor.models.deepseek_v4.mtp import DeepseekV4MTP

transformers = pytest.importorskip("transformers")
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf  # noqa: E402

H, VOCAB, N, WINDOW, T = 64, 97, 2, 8, 20  # T > 2 * WINDOW
ATOL = 1e-4


def tiny_config(mlp_type: str, num_mtp: int = 1):
    """One main layer of `mlp_type`; the MTP's block is score-routed whatever the main layers are."""
    cfg = transformers.DeepseekV4Config(
        hidden_size=H, num_hidden_layers=1, vocab_size=VOCAB, n_routed_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, hc_mult=N, hc_sinkhorn_iters=20, num_attention_heads=2, head_dim=32,
        qk_rope_head_dim=16, q_lora_rank=16, o_lora_rank=16, o_groups=1, sliding_window=WINDOW,
        layer_types=["sliding_attention"], mlp_layer_types=[mlp_type], swiglu_limit=0.75,
        num_nextn_predict_layers=num_mtp,
    )
    cfg._attn_implementation = "eager"
    return cfg


class RefMTP(nn.Module):
    """One MTP layer from HF modules; the embedding and head are passed in (shared with the main model)."""

    def __init__(self, cfg, seed: int):
        super().__init__()
        self.cfg = cfg
        self.enorm, self.hnorm, self.norm = (hf.DeepseekV4RMSNorm(H, cfg.rms_norm_eps) for _ in range(3))
        self.e_proj, self.h_proj = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self.block = hf.DeepseekV4DecoderLayer(cfg, 0)  # sliding_attention + "moe" (score routed)
        self.hc_head = hf.DeepseekV4HyperHead(cfg)
        self.rotary = hf.DeepseekV4RotaryEmbedding(cfg)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if name.endswith("scale") else 0.0))
            self.block.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.5)
            for proj in (self.e_proj, self.h_proj):  # what an FP8 checkpoint holds: e4m3 values * 2^-2
                proj.weight.copy_((proj.weight * 4).to(torch.float8_e4m3fn).float() / 4)
        self.float().eval()

    @torch.no_grad()
    def forward(self, prev: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                embed_w: torch.Tensor, head_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [T, N, H], next_ids [T], positions [T] -> (streams [T, N, H], logits [T, V])."""
        e = F.embedding(next_ids, embed_w)  # [T, H]
        e = torch.where(positions[:, None] == 0, torch.zeros_like(e), e)  # vLLM: no MTP input at position 0
        x = self.h_proj(self.hnorm(prev)) + self.e_proj(self.enorm(e)).unsqueeze(-2)  # [T, N, H]
        pos = positions[None]  # [1, T]
        emb = {label: self.rotary(e[None], pos, layer_type=label) for label in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=self.cfg, inputs_embeds=e[None], attention_mask=None,
                                                 cache=None, position_ids=pos)
        out = self.block(x[None], input_ids=next_ids[None], position_embeddings=emb, position_ids=pos,
                         attention_mask=mask)[0]  # [T, N, H]
        return out, F.linear(self.norm(self.hc_head(out[None]))[0], head_w)


def e8m0(exponent: int) -> torch.Tensor:
    return torch.tensor([[exponent + 127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # [1, 1] block grid


def v4_checkpoint(ref: RefMTP, i: int) -> list[tuple[str, torch.Tensor]]:
    """The reference's weights under DeepSeek-V4 checkpoint names `mtp.{i}.*` (DeepSeek's layout)."""
    b, p = ref.block, f"mtp.{i}."
    a, m = b.self_attn, b.mlp
    out = {
        "enorm.weight": ref.enorm.weight, "hnorm.weight": ref.hnorm.weight, "norm.weight": ref.norm.weight,
        "hc_head_fn": ref.hc_head.hc_fn, "hc_head_base": ref.hc_head.hc_base, "hc_head_scale": ref.hc_head.hc_scale,
        "attn_norm.weight": b.input_layernorm.weight, "ffn_norm.weight": b.post_attention_layernorm.weight,
        "hc_attn_fn": b.attn_hc.fn, "hc_attn_base": b.attn_hc.base, "hc_attn_scale": b.attn_hc.scale,
        "hc_ffn_fn": b.ffn_hc.fn, "hc_ffn_base": b.ffn_hc.base, "hc_ffn_scale": b.ffn_hc.scale,
        "attn.wq_a.weight": a.q_a_proj.weight, "attn.q_norm.weight": a.q_a_norm.weight,
        "attn.wq_b.weight": a.q_b_proj.weight, "attn.wkv.weight": a.kv_proj.weight,
        "attn.kv_norm.weight": a.kv_norm.weight, "attn.wo_a.weight": a.o_a_proj.weight,
        "attn.wo_b.weight": a.o_b_proj.weight, "attn.attn_sink": a.sinks,
        "ffn.gate.weight": m.gate.weight, "ffn.gate.bias": m.gate.e_score_correction_bias,
        "ffn.shared_experts.w1.weight": m.shared_experts.gate_proj.weight,
        "ffn.shared_experts.w3.weight": m.shared_experts.up_proj.weight,
        "ffn.shared_experts.w2.weight": m.shared_experts.down_proj.weight,
        "e_proj.weight": (ref.e_proj.weight * 4).to(torch.float8_e4m3fn), "e_proj.scale": e8m0(-2),
        "h_proj.weight": (ref.h_proj.weight * 4).to(torch.float8_e4m3fn), "h_proj.scale": e8m0(-2),
    }
    for e in range(m.experts.gate_up_proj.shape[0]):
        gate, up = m.experts.gate_up_proj[e].chunk(2)
        out |= {f"ffn.experts.{e}.w1.weight": gate, f"ffn.experts.{e}.w3.weight": up,
                f"ffn.experts.{e}.w2.weight": m.experts.down_proj[e]}
    return [(p + name, t.detach().clone()) for name, t in out.items()]


def build(num_mtp: int = 1, num_ref: int | None = None):
    """(ours loaded from the V4-named checkpoint, the reference layers, a main model with random embed / head)."""
    refs = [RefMTP(tiny_config("moe", num_mtp), seed=10 + i) for i in range(num_ref or num_mtp)]
    cfg = tiny_config("hash_moe", num_mtp)
    main = DeepseekV4ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        main.model.embed_tokens.weight.copy_(torch.randn(VOCAB, H, generator=gen))
        main.lm_head.weight.copy_(torch.randn(VOCAB, H, generator=gen) * 0.3)
    ours = DeepseekV4MTP(cfg).float().eval()
    ckpt = [("embed.weight", main.model.embed_tokens.weight), ("layers.0.attn.wq_a.weight", torch.zeros(1)),
            ("mtp.0.emb.tok_emb.weight", main.model.embed_tokens.weight), ("mtp.0.head.weight", main.lm_head.weight)]
    for i, ref in enumerate(refs):
        ckpt += v4_checkpoint(ref, i)
    loaded = ours.load_weights(ckpt)
    assert loaded == {n for n, _ in ours.named_parameters()}
    return ours, refs, main


def inputs(seed: int = 2, num_tokens: int = T) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prev = torch.randn(num_tokens, N, H, generator=gen)  # [T, N, H] the main model's pre-hc_head streams
    return prev, torch.randint(0, VOCAB, (num_tokens + 1,), generator=gen).tolist()


@pytest.mark.parametrize("start_pos", [0, 5])
def test_mtp_layer_logits_match_reference(start_pos):
    ours, (ref,), main = build()
    layer = ours.layers[0]
    assert not layer.mlp.is_hash and main.model.layers[0].mlp.is_hash
    prev, tokens = inputs()
    next_ids, positions = torch.tensor(tokens[1:]), start_pos + torch.arange(T)  # [T], [T]
    embed_w, head_w = main.model.embed_tokens.weight, main.lm_head.weight
    ref_streams, ref_logits = ref(prev, next_ids, positions, embed_w, head_w)
    with torch.no_grad():
        streams = layer(prev, F.embedding(next_ids, embed_w), positions, next_ids)  # [T, N, H]
        logits = layer.logits(streams, head_w)  # [T, V]
    assert ref_logits.abs().max() > 1.0  # not a degenerate comparison
    torch.testing.assert_close(streams, ref_streams, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


def test_position_zero_embedding_is_masked():
    """At position 0 the next token's embedding is zeroed (vLLM), so that token changes nothing."""
    ours, _, main = build()
    layer, embed_w = ours.layers[0], main.model.embed_tokens.weight
    prev, tokens = inputs()
    a, b = torch.tensor(tokens[1:]), torch.tensor(tokens[1:])
    b[0] = (b[0] + 1) % VOCAB
    with torch.no_grad():
        out_a = layer(prev, F.embedding(a, embed_w), torch.arange(T), a)
        out_b = layer(prev, F.embedding(b, embed_w), torch.arange(T), b)
        out_c = layer(prev, F.embedding(b, embed_w), 1 + torch.arange(T), b)
        out_d = layer(prev, F.embedding(a, embed_w), 1 + torch.arange(T), a)
    assert torch.equal(out_a, out_b)
    assert not torch.allclose(out_c, out_d, atol=1e-3)  # elsewhere it matters


def chain_reference(refs: list[RefMTP], main, prev: torch.Tensor, tokens: list[int], k: int) -> list[int]:
    """Draft by hand: step j runs refs[j % L] over the whole extended sequence from position 0."""
    rows, next_ids, drafts = list(prev.unbind(0)), list(tokens[1:]), []
    for step in range(k):
        ref = refs[step % len(refs)]
        out, logits = ref(torch.stack(rows), torch.tensor(next_ids), torch.arange(len(rows)),
                          main.model.embed_tokens.weight, main.lm_head.weight)
        drafts.append(int(logits[-1].argmax()))
        rows.append(out[-1])
        next_ids.append(drafts[-1])
    return drafts


@pytest.mark.parametrize("num_mtp", [1, 2])
def test_propose_matches_chained_reference(num_mtp):
    ours, refs, main = build(num_mtp)
    prev, tokens = inputs(seed=3)
    expected = chain_reference(refs, main, prev, tokens, k=3)
    assert ours.propose(main, tokens, 3, prev) == expected
    # the window is all the attention reads: the last WINDOW positions give the same drafts
    assert ours.propose(main, tokens[T - WINDOW:], 3, prev[T - WINDOW:], start_pos=T - WINDOW) == expected


def test_extra_mtp_layers_in_checkpoint_are_skipped():
    ours, refs, _ = build(num_mtp=1, num_ref=2)
    assert len(ours.layers) == 1 and len(refs) == 2


@pytest.mark.parametrize("k", [0, -1])
def test_propose_rejects_bad_k(k):
    ours, _, main = build()
    prev, tokens = inputs()
    with pytest.raises(ValueError, match="k must be"):
        ours.propose(main, tokens, k, prev)


def test_propose_rejects_mismatched_tokens():
    ours, _, main = build()
    prev, tokens = inputs()
    with pytest.raises(ValueError, match="token_ids"):
        ours.propose(main, tokens[:-1], 2, prev)


def test_load_weights_reports_missing():
    cfg = tiny_config("moe")
    ckpt = [(n, t) for n, t in v4_checkpoint(RefMTP(cfg, seed=0), 0) if not n.startswith("mtp.0.hc_head")]
    with pytest.raises(ValueError, match="lacks 3 MTP parameters"):
        DeepseekV4MTP(cfg).load_weights(ckpt)

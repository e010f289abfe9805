"""DeepSeek-V3's MTP layer as a draft proposer, against transformers' own MTP module (`MtpModel`).

transformers 5 builds V3's next-n layer from its own modules (enorm, hnorm, eh_proj, a DeepseekV3
decoder layer, post_norm = the checkpoint's `shared_head.norm`) and drafts one token from it; the
checkpoint here carries that module's random weights under DeepSeek's names (`model.layers.3.*`,
experts one matrix each, with the copies of the embedding and head DeepSeek ships). Drafting chains
the layer k times, each pass reading the previous pass's output before its norm (vLLM's chain).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from v3_tiny import VOCAB, add_tensors, hf_mtp, make_tiny, mtp_checkpoint_tensors

from deepinfer import LLM, SamplingParams
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.forward_context import forward_context

pytestmark = [pytest.mark.parity]

ENGINE = dict(dtype="float32", block_size=4, max_model_len=96, enable_prefix_caching=False)
NUM_LAYERS = 3


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    """(path, HF main model, HF MtpModel) with random weights everywhere."""
    path = str(tmp_path_factory.mktemp("v3mtp"))
    hf = make_tiny(path, num_nextn_predict_layers=1)
    mtp = hf_mtp(hf)
    add_tensors(path, mtp_checkpoint_tensors(mtp, NUM_LAYERS))
    return path, hf, mtp


@pytest.fixture(scope="module")
def drafting_mtp(tmp_path_factory):
    """A checkpoint whose MTP layer often guesses right: the main layers add little to the token's
    embedding (o_proj and down projections x 0.1), and the MTP layer passes enorm(embed(next token))
    through (eh_proj = [I | 0], its attention and MoE outputs zero) to the main model's norm and head,
    so it drafts roughly what the main model predicts from that token alone."""
    path = str(tmp_path_factory.mktemp("v3mtp_drafting"))
    hf = make_tiny(path, seed=4, num_nextn_predict_layers=1)
    outputs = ("o_proj.weight", "down_proj.weight", "experts.down_proj")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(outputs):
                p.mul_(0.1)
        hf.save_pretrained(path)
        mtp = hf_mtp(hf)
        layer, h = mtp.layers[0], hf.config.hidden_size
        layer.eh_proj.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], 1))
        layer.enorm.weight.fill_(1.0)
        layer.post_norm.weight.copy_(hf.model.norm.weight)
        for name, p in layer.mtp_block.named_parameters():
            if name.endswith(outputs):
                p.zero_()
    add_tensors(path, mtp_checkpoint_tensors(mtp, NUM_LAYERS))
    return path


@torch.no_grad()
def hf_hidden(hf, tokens: list[int]) -> torch.Tensor:
    """The main model's final hidden states [T, H], after its norm: what transformers' MTP generator
    reads (`hidden_states[-1]`)."""
    out = hf(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    h = out.hidden_states[-1][0]  # [T, H]
    torch.testing.assert_close(hf.lm_head(h), out.logits[0])  # the head's input
    return h


@torch.no_grad()
def hf_block(mtp, prev: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
    """transformers' MTP layer up to (not including) its post_norm, over positions 0 .. n-1: [n, H]."""
    layer, ids = mtp.layers[0], torch.tensor([next_ids])
    embeds = mtp.embed_tokens(ids)  # [1, n, H]
    x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(prev[None])], -1))  # [1, n, H]
    pos = torch.arange(len(next_ids))[None]
    masks = mtp.create_masks_for_mtp_layer(0, embeds, None, pos)
    return layer.mtp_block(x, position_embeddings=mtp.rotary_emb(embeds, pos), position_ids=pos, **masks)[0]


@torch.inference_mode()
def test_mtp_layer_logits_match_transformers(random_mtp):
    """Pass 0 over a prompt, through the engine's "mtp" ring: the logits of every position equal
    transformers' `MtpModel.forward_layer` + its head on the same main-model states."""
    path, hf, mtp = random_mtp
    llm = LLM(path, speculative_method="mtp", num_speculative_tokens=2, **ENGINE)
    runner = llm.engine.runner
    model, layer = runner.model, runner.model.mtp.layers[0]
    assert [(g.name, g.kind, g.window) for g in runner.groups] == [("mla", "paged", None), ("mtp", "ring", 96)]
    rng = random.Random(1)
    tokens = [rng.randrange(3, VOCAB) for _ in range(22)]
    h = hf_hidden(hf, tokens[:-1])  # [T, H]
    ids = torch.tensor(tokens[1:])
    hidden = mtp.forward_layer(0, h[None], torch.arange(len(ids))[None], None, input_ids=ids[None])
    want = mtp._project_to_logits(hidden)[0]  # [T, V]
    sched = ScheduledRequest("r", tokens[1:], 0, ([0],), (0,))
    md, _ = runner.steps.drafter.metadata([sched])  # the "mtp" group's pass metadata
    with forward_context(md):
        streams = layer.forward_cached(h[:, None], F.embedding(ids, model.model.embed_tokens.weight), md.positions,
                                       ids)  # [T, 1, H]
    got = layer.logits(streams, model.lm_head.weight)  # [T, V]
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_drafts_after_a_prefill_follow_the_chain(random_mtp):
    """After one prefill step the request holds k = 2 drafts: pass 0 over the prompt's final hidden
    states with the sampled token, then pass 1 one position on, fed pass 0's last output before
    post_norm (transformers' own generator drafts only pass 0's token from one layer)."""
    path, hf, mtp = random_mtp
    llm = LLM(path, speculative_method="mtp", num_speculative_tokens=2, max_num_batched_tokens=64, **ENGINE)
    rng = random.Random(2)
    prompt = [rng.randrange(3, VOCAB) for _ in range(17)]
    rid = llm.engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    llm.engine.step()
    req = llm.engine.scheduler.get_request(rid)
    (sampled,) = req.output_token_ids
    rows, next_ids, want = list(hf_hidden(hf, prompt).unbind(0)), prompt[1:] + [sampled], []
    for _ in range(2):
        last = hf_block(mtp, torch.stack(rows), next_ids)[-1]  # [H]
        want.append(int(mtp._project_to_logits(mtp.layers[0].post_norm(last)).argmax()))
        rows.append(last)
        next_ids.append(want[-1])
    assert req.draft_token_ids == want


def test_mtp_drafting_is_greedy_identical(drafting_mtp):
    """Greedy tokens with MTP drafts (some accepted, some rejected) equal plain decoding's, with
    chunked prefill and a pool small enough to preempt; no block or state slot leaks."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 17, 30, 11)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine = dict(num_blocks=24, max_num_batched_tokens=13, max_num_seqs=4, **ENGINE)
    with LLM(drafting_mtp, **engine) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    with LLM(drafting_mtp, speculative_method="mtp", num_speculative_tokens=3, **engine) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        metrics = llm.get_metrics()
        llm.engine.kv_manager.check_no_leaks()
        preemptions = llm.engine.scheduler.num_preemptions_total
    assert got == want
    assert 0 < metrics["spec_decode_num_accepted_tokens"] < metrics["spec_decode_num_draft_tokens"]
    assert preemptions > 0


def test_mtp_needs_the_checkpoints_mtp_layers(tmp_path):
    make_tiny(str(tmp_path), num_nextn_predict_layers=1)  # no model.layers.3.* tensors
    with pytest.raises(ValueError, match=r"needs the checkpoint's MTP layers \(model\.layers\.3\.\*\)"):
        LLM(str(tmp_path), speculative_method="mtp", **ENGINE)


def test_v2_has_no_mtp(tmp_path):
    make_tiny(str(tmp_path), "deepseek_v2")
    with pytest.raises(ValueError, match="needs a model with MTP"):
        LLM(str(tmp_path), speculative_method="mtp", **ENGINE)

"""The optional config fields each family declares (`HFConfigFields` subclasses): defaults where a
config leaves a field out, the config's value (None included) where it sets one, and the specs built
from them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import Gemma3TextConfig, MistralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.model_executor.layers.mxfp4_moe import SWIGLU_ALPHA
from deepinfer.model_executor.models.deepseek_v3.config import (
    DeepseekConfigFields,
    check_config,
    interleaved_rope,
    num_mtp_layers,
)
from deepinfer.model_executor.models.deepseek_v4.config import DeepseekV4ConfigFields
from deepinfer.model_executor.models.gemma3 import GemmaConfigFields, gemma3_rotaries, gemma_spec
from deepinfer.model_executor.models.gpt_oss import GptOssConfigFields
from deepinfer.model_executor.models.llama import LlamaConfigFields, llama_spec
from deepinfer.model_executor.models.moe_llama import QWEN2_MOE, QWEN3_MOE, MoeConfigFields, moe_spec

SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
             vocab_size=50)


def test_a_field_left_out_takes_the_family_default():
    bare = SimpleNamespace()
    assert HFConfigFields.of(bare) == HFConfigFields()
    assert not LlamaConfigFields.of(bare).tie_word_embeddings and GemmaConfigFields.of(bare).tie_word_embeddings
    assert (LlamaConfigFields.of(bare).attention_bias, GptOssConfigFields.of(bare).attention_bias) == (False, True)
    assert GptOssConfigFields.of(bare).swiglu_alpha == SWIGLU_ALPHA
    assert (MoeConfigFields.of(bare).norm_topk_prob, DeepseekV4ConfigFields.of(bare).norm_topk_prob) == (False, True)
    assert DeepseekConfigFields.of(bare).rope_interleave is True
    assert GemmaConfigFields.of(bare).max_position_embeddings == 4096  # the engine's fields come along


def test_a_field_set_is_read_none_included():
    cfg = SimpleNamespace(tie_word_embeddings=False, sliding_window=None, head_dim=None, max_position_embeddings=64,
                          num_hash_layers=2, swiglu_limit=None)
    gemma = GemmaConfigFields.of(cfg)
    assert (gemma.tie_word_embeddings, gemma.sliding_window, gemma.head_dim) == (False, None, None)
    assert gemma.max_position_embeddings == 64
    v4 = DeepseekV4ConfigFields.of(cfg)
    assert (v4.num_hash_layers, v4.swiglu_limit, v4.n_shared_experts) == (2, None, 1)


def test_llama_spec_reads_windows_head_dim_and_biases():
    spec = llama_spec(MistralConfig(**SMALL, sliding_window=5, head_dim=16))
    assert spec.windows == (5, 5, 5) and spec.head_dim == 16 and spec.attn_scale == 16**-0.5
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias, spec.tie_word_embeddings) == (False, False, False, False)
    mixed = SimpleNamespace(**SMALL, model_type="llama", sliding_window=5, attention_bias=True,
                            layer_types=["full_attention", "sliding_attention", "full_attention", "extra"])
    spec = llama_spec(mixed)
    assert spec.windows == (None, 5, None) and spec.head_dim == 8  # hidden_size / heads
    assert spec.qkv_bias and spec.o_bias
    assert llama_spec(mixed, GptOssConfigFields.of(SimpleNamespace())).o_bias  # the fields passed in decide


def test_gemma_spec_ties_the_head_unless_told_and_refuses_bidirectional():
    cfg = Gemma3TextConfig(**SMALL, head_dim=8, layer_types=["sliding_attention"] * 3, sliding_window=4)
    del cfg.tie_word_embeddings  # a config that leaves it out: Gemma's head is tied
    assert gemma_spec(cfg, qk_norm=True, rotaries=gemma3_rotaries).tie_word_embeddings
    cfg.tie_word_embeddings = False
    assert not gemma_spec(cfg, qk_norm=True, rotaries=gemma3_rotaries).tie_word_embeddings
    cfg.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        gemma_spec(cfg, qk_norm=True, rotaries=gemma3_rotaries)


def _moe_config(cls, **kw):
    return cls(**SMALL, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, **kw)


def test_moe_spec_reads_qkv_bias_only_for_qwen2_moe_and_the_dense_layers():
    assert moe_spec(_moe_config(Qwen2MoeConfig, qkv_bias=True, shared_expert_intermediate_size=16), QWEN2_MOE).qkv_bias
    assert not moe_spec(_moe_config(Qwen2MoeConfig, qkv_bias=False, shared_expert_intermediate_size=16),
                        QWEN2_MOE).qkv_bias
    qwen3 = _moe_config(Qwen3MoeConfig, mlp_only_layers=[1])
    qwen3.qkv_bias = True  # not a Qwen3-MoE field: ignored
    spec = moe_spec(qwen3, QWEN3_MOE)
    assert not spec.qkv_bias and spec.qk_norm
    assert spec.mlp.args[0] == (True, False, True)  # layer 1 dense
    qwen3.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        moe_spec(qwen3, QWEN3_MOE)


def test_deepseek_v3_fields_absent_and_refused():
    v3 = SimpleNamespace(model_type="deepseek_v3", n_routed_experts=None)
    assert interleaved_rope(v3) and num_mtp_layers(v3) == 0
    v3.rope_interleave, v3.num_nextn_predict_layers = False, None
    assert not interleaved_rope(v3) and num_mtp_layers(v3) == 0
    assert interleaved_rope(SimpleNamespace(model_type="deepseek_v2", rope_interleave=False))
    check_config(v3)
    v3.moe_layer_freq = 2
    with pytest.raises(ValueError, match="moe_layer_freq=2"):
        check_config(v3)


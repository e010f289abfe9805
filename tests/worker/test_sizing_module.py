"""One sizing of the KV cache (`worker/cache_sizing.py`): the capacity planner, `deepinfer info`, the
benchmarks and the engine all size through `plan_model_cache`, so their figures agree.

For every supported architecture (the tiny checkpoints, and a tiny DeepSeek-V4 with sliding, CSA and
HCA layers) the planner's bytes per token, fixed bytes per request, page and blocks per request equal
what the engine allocated (`runner.caches.cache`, the model's kept state), with the default draft allowance
and with n-gram drafting at k = 3 (a smaller ring: S = W + max(backtracking, k + 1)). The planner
builds rank 0 on the meta device and reads its declared groups; V4-Flash cannot be allocated here, so
its plan is checked against the sizing of the meta-built model's groups and against the config's
fields by hand.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from deepinfer import LLM
from deepinfer.config import SpeculativeConfig
from deepinfer.entrypoints import cli
from deepinfer.entrypoints.capacity_plan import load_config, meta_model, plan_capacity
from deepinfer.worker.cache_sizing import plan_model_cache, ring_size

pytestmark = [pytest.mark.parity]

FLASH = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "deepseek_v4_flash")
ARCHS = ["llama", "llama3", "qwen2", "qwen3", "mistral", "mistral_swa", "qwen2_swa", "gemma3", "v4"]
DRAFTS = {"default": None, "ngram3": SpeculativeConfig("ngram", 3)}


@pytest.fixture(scope="module")
def v4_config_dir(tmp_path_factory) -> str:
    """A tiny DeepSeek-V4 (sliding, CSA, HCA layers), config.json only: dummy weights."""
    from models.deepseek_v4.v4_tiny import CSA, HCA, SLIDING, tiny_v4_config

    path = tmp_path_factory.mktemp("v4-sizing")
    tiny_v4_config([SLIDING, CSA, HCA]).save_pretrained(path)
    return str(path)


def _engine(arch: str, draft: str, tiny_checkpoint, v4_config_dir) -> LLM:
    spec = DRAFTS[draft]
    kwargs = dict(speculative_method=spec.method, num_speculative_tokens=spec.num_speculative_tokens) if spec else {}
    if arch == "v4":  # MXFP8 rows: the planner's rows for deepseek_v4
        return LLM(v4_config_dir, load_format="dummy", max_model_len=64, max_num_seqs=2, num_blocks=12,
                   kv_cache_dtype="fp8", **kwargs)
    return LLM(tiny_checkpoint(arch), max_model_len=64, max_num_seqs=2, num_blocks=12, kv_cache_dtype="bfloat16",
               **kwargs)


def _kept_state_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.read_state(0).values() if t.is_floating_point())


@pytest.mark.parametrize("draft", list(DRAFTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_the_planner_sizes_what_the_engine_allocates(arch, draft, tiny_checkpoint, v4_config_dir):
    llm = _engine(arch, draft, tiny_checkpoint, v4_config_dir)
    runner, cfg = llm.engine.runner, llm.engine.source.hf_config.to_dict()
    plan = plan_capacity(cfg, max_model_len=64, speculative=DRAFTS[draft], env=runner.config.env).kv
    assert [g.name for g in plan.groups] == [g.name for g in runner.groups]
    k = 3 if draft == "ngram3" else runner.config.env.use_nextn_decode
    assert plan.num_speculative_tokens == runner.config.speculative.num_speculative_tokens == k
    cache = runner.caches.cache
    for gi, (g, want) in enumerate(zip(runner.groups, plan.groups, strict=True)):
        assert want.rows_per_unit == g.rows_per_unit
        if g.is_ring:  # S = W + max(backtracking, k + 1) rows per state slot, all the group's layers
            assert g.rows_per_unit == g.window + max(runner.config.env.max_backtracking_tokens, k + 1)
            assert want.per_request == cache.allocations[gi].shape[1] == cache.unit_bytes(gi)
            assert want.visible_rows(64) == min(64, g.window) < g.rows_per_unit
        else:
            assert want.per_token == cache.unit_bytes(gi) / (g.rows_per_unit * g.compress_ratio)
            assert plan.page_bytes == cache.allocations[gi].shape[1]
    assert plan.state_bytes == _kept_state_bytes(runner.model)
    assert (plan.state_bytes > 0) == (arch == "v4")
    rings = sum(cache.allocations[gi].shape[1] for gi, g in enumerate(runner.groups) if g.is_ring)
    assert plan.per_request == rings + plan.state_bytes
    assert cache.num_bytes == runner.num_blocks * plan.page_bytes + runner.num_state_slots * plan.ring_bytes + \
        runner.num_snapshot_slots * plan.ring_bytes
    # one request at max_model_len: the engine's need and the scheduler's blocks
    assert plan.request_need(64) == runner.caches.cache_need
    assert plan.blocks_for(64) == sum(spec.num_blocks_for(64) for spec in llm.engine.kv_manager.paged_specs)
    assert plan.request_bytes(64) == plan.per_request + runner.caches.cache_need.paged_bytes


@pytest.mark.parametrize("arch", ["mistral_swa", "v4"])
def test_ngram_k3_shrinks_the_ring_in_the_engine_and_the_plan(arch, tiny_checkpoint, v4_config_dir):
    default = _engine(arch, "default", tiny_checkpoint, v4_config_dir).engine.runner
    ngram = _engine(arch, "ngram3", tiny_checkpoint, v4_config_dir).engine.runner
    ring = next(gi for gi, g in enumerate(default.groups) if g.is_ring)
    window = default.groups[ring].window
    assert default.groups[ring].rows_per_unit == window + 6 and ngram.groups[ring].rows_per_unit == window + 4
    assert ngram.caches.sizing.ring_bytes < default.caches.sizing.ring_bytes


@pytest.fixture(scope="module")
def flash() -> dict:
    return load_config(FLASH)


@pytest.mark.parametrize("spec", [None, SpeculativeConfig("ngram", 3)])
def test_v4_flash_plan_is_the_sizing_of_the_meta_built_model(flash, spec):
    from deepinfer.environ import read_environ

    env = read_environ({})
    plan = plan_capacity(flash, 8, 8, max_model_len=131072, speculative=spec, env=env)
    model = meta_model(flash, 8, 8, 131072)
    k = 3 if spec else 5
    assert plan_model_cache(model, torch.bfloat16, "fp8", 16, env, k)[2] == plan.kv
    # by hand from the config: 43 window rings of S = 128 + max(0, k + 1) MXFP8 rows (512 + 16 B)
    s = ring_size(128, env, k)
    assert s == 128 + k + 1
    assert plan.kv.ring_bytes == 43 * s * 528
    assert plan.kv.per_token == 20 * (528 + 132) / 4 + 23 * 528 / 128
    assert plan.kv.state_bytes == 20 * 4 * 2 * 4 * (1024 + 512 + 256 + 128) + 23 * 4 * 2 * 128 * 512
    assert plan.kv.page_bytes == 16 * 23 * 528  # the widest paged group: 23 HCA layers


@pytest.mark.multirank
def test_the_planner_follows_the_speculative_flags(capsys):
    """`deepinfer info` plans the rings for the engine's k, not for the process environment alone."""
    def ring_line(*flags: str) -> str:
        assert cli.main(["info", "--model", FLASH, "--tensor-parallel-size", "8", *flags]) == 0
        return re.search(r"window ring: (.*)", capsys.readouterr().out).group(1)

    assert ring_line().startswith("43 layers x 134 rows (S) x 528 B = 3,042,336 B per request")
    assert ring_line("--speculative-method", "ngram", "--num-speculative-tokens", "3") \
        .startswith(f"43 layers x 132 rows (S) x 528 B = {43 * 132 * 528:,} B per request")
    assert ring_line("--num-speculative-tokens", "9").startswith("43 layers x 138 rows (S)")

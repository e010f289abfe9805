"""The sampler leaves its draws on the device and reads them back once.

`Sampler.draw` returns device tensors; `read_samples` turns them into SampleResults with one
`tolist()` (tokens, logprobs, ranks and top logprobs together). Off the CPU the top-k / top-p
search decides every row in one window pass (no host check of which rows are done): on the CPU
that pass, forced, finds the thresholds the widening loop finds."""

from __future__ import annotations

import pytest
import torch

from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.layers import token_draws
from deepinfer.model_executor.layers.sampled_tokens import DrawnTokens, read_samples
from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.model_executor.layers.sampling_metadata import device_tensor
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.sampling_inputs import build_sampling_metadata

VOCAB = 3000


def _row(i: int, params: SamplingParams) -> ScheduledRequest:
    return ScheduledRequest(f"r{i}", [0], 5, ([],), sampling_params=params, prompt_token_ids=[1, 2, 3])


PARAMS = [SamplingParams(temperature=0.0, logprobs=3),
          SamplingParams(temperature=0.8, top_p=0.9, top_k=20),
          SamplingParams(temperature=1.2, top_p=0.5, logprobs=0),
          SamplingParams(temperature=0.7, top_k=400, min_p=0.01, logprobs=5),
          SamplingParams(temperature=0.0)]


def _inputs(params=PARAMS, seed: int = 0):
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(seed)) * 4.0  # [N, V]
    return logits, build_sampling_metadata([_row(i, p) for i, p in enumerate(params)], torch.device("cpu"))


def _count_reads(monkeypatch) -> list[str]:
    reads = []
    for name in ("tolist", "item"):
        real = getattr(torch.Tensor, name)

        def counting(self, *args, _real=real, _name=name, **kwargs):
            reads.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return reads


def test_draw_leaves_tensors_and_call_reads_once(monkeypatch):
    logits, metadata = _inputs()
    reads = _count_reads(monkeypatch)
    drawn = Sampler(seed=3).draw(logits, metadata)
    assert reads == []
    assert isinstance(drawn, DrawnTokens) and drawn.token_ids.shape == (5,) and drawn.top_ids.shape == (3, 5)
    results = Sampler(seed=3)(logits, metadata)
    assert reads == ["tolist"]
    assert [r.token_id for r in results] == drawn.token_ids.tolist()


def test_read_gives_what_the_tensors_hold():
    logits, metadata = _inputs()
    drawn = Sampler(seed=3).draw(logits, metadata)
    results = read_samples(drawn, metadata)
    logprobs = torch.log_softmax(logits, dim=-1)  # [N, V]
    assert results[0].token_id == int(logits[0].argmax()) and results[4].token_id == int(logits[4].argmax())
    for i, r in enumerate(results):
        assert r.logprob == pytest.approx(float(logprobs[i, r.token_id]), abs=1e-5)
        assert isinstance(r.token_id, int)
    assert [r.rank for r in results] == [1, None, _rank(logits[2], results[2].token_id),
                                         _rank(logits[3], results[3].token_id), None]
    assert results[2].top_logprobs == [] and results[1].top_logprobs is None
    best = logprobs[3].topk(5)
    assert [t for t, _ in results[3].top_logprobs] == best.indices.tolist()
    assert [lp for _, lp in results[3].top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-5)
    assert len(results[0].top_logprobs) == 3 and all(isinstance(t, int) for t, _ in results[0].top_logprobs)


def _rank(row: torch.Tensor, token_id: int) -> int:
    return int((row > row[token_id]).sum()) + 1


def test_greedy_batch_without_logprobs_reads_tokens_and_logprobs_only():
    logits, metadata = _inputs([SamplingParams(temperature=0.0)] * 3)
    drawn = Sampler().draw(logits, metadata)
    assert drawn.ranks is None and drawn.top_ids is None
    assert [r.token_id for r in read_samples(drawn, metadata)] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_k", [[0, 0, 0], [1, 40, 200], [0, 300, 2999], [5, 0, 3000]])
@pytest.mark.parametrize("scale", [0.5, 3.0, 10.0])
def test_one_window_pass_finds_the_loops_thresholds(top_k, scale):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(11)) * scale  # [3, V]
    weights = token_draws.exp_relative(logits, logits.amax(dim=-1, keepdim=True))  # [3, V]
    ks = [k if 0 < k < VOCAB else VOCAB for k in top_k]
    k_col = torch.tensor(ks)[:, None]  # [3, 1]
    p_col = torch.tensor([0.3, 0.9, 0.999])[:, None]  # [3, 1]
    looped = token_draws._nucleus_threshold(logits, weights, k_col, p_col, one_pass=False)  # [3, 1]
    one = token_draws._nucleus_threshold(logits, weights, k_col, p_col, max_k=max(ks), one_pass=True)  # [3, 1]
    assert torch.equal(logits >= one, logits >= looped)


def test_device_tensor_stays_on_the_cpu_and_moves_elsewhere():
    host = device_tensor([1, 2, 3], torch.long, torch.device("cpu"))
    assert host.tolist() == [1, 2, 3] and host.device.type == "cpu"
    moved = device_tensor([0.5, 1.5], torch.float32, "meta")
    assert moved.device.type == "meta" and moved.dtype == torch.float32 and moved.shape == (2,)

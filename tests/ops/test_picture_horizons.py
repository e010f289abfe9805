"""Prefill attention with per-query horizons (a picture's run seen whole, Gemma 3) against a plain
float64 formula: query p over keys k with max(p - W, -1) < k <= h(p), h(p) >= p its horizon."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.model_executor.layers.ops import torch_attention as torch_ref

H, HKV, D = 4, 2, 16


def _reference(q, k_all, v_all, q_pos, key_pos, horizons, window, scale, softcap):
    """Dense float64 attention of each query over the keys its horizon and window allow."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        for h in range(H):
            kv = h // (H // HKV)
            seen = [j for j, kp in enumerate(key_pos.tolist()) if kp <= horizons[i]
                    and (window is None or kp > q_pos[i] - window)]
            s = torch.stack([q[i, h].double() @ k_all[j, kv].double() * scale for j in seen])
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            p = torch.softmax(s, 0)
            out[i, h] = sum(p[n] * v_all[j, kv].double() for n, j in enumerate(seen))
    return out


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_prefill_sees_each_run_whole(window, softcap):
    g = torch.Generator().manual_seed(0)
    n_old, n = 3, 10
    q = torch.randn(n, H, D, generator=g)
    k, v = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
    loaded = torch.randn(n_old, 2, HKV, D, generator=g)
    loaded_pos, q_pos = torch.arange(5, 5 + n_old), torch.arange(8, 8 + n)
    horizons = q_pos.clone()
    horizons[2:7] = 14  # a run at positions 10..14 (chunk rows 2..6)
    got = torch_ref.prefill_attention(q, k, v, loaded, q_pos, loaded_pos, 1 / math.sqrt(D), window, softcap,
                                      None, horizons)
    ref = _reference(q, torch.cat((loaded[:, 0], k)), torch.cat((loaded[:, 1], v)), q_pos,
                     torch.cat((loaded_pos, q_pos)), horizons, window, 1 / math.sqrt(D), softcap)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    causal = torch_ref.prefill_attention(q, k, v, loaded, q_pos, loaded_pos, 1 / math.sqrt(D), window, softcap)
    assert torch.equal(got[7:], causal[7:]) and torch.equal(got[:2], causal[:2])  # text rows: causal
    assert (got[2:6] - causal[2:6]).abs().max() > 1e-3  # the run's rows (but its last) see ahead

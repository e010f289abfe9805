"""Large linear layers on a few rows: W @ x.T gives F.linear's result (up to rounding), and the
switch follows the start-up probe and leaves small layers and other row counts alone."""

import torch
from torch import nn

import deepinfer.model_executor.layers.linear as linear


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 8192, bias=True), nn.Linear(8192, 16))  # 4M and 128K elements


def test_few_rows_match_f_linear_and_other_shapes_pass_through():
    model, ref = _model(), _model()
    model[0].__class__ = linear.FewRowLinear
    for shape in [(1, 512), (3, 512), (2, 5, 512), (16, 512), (17, 512)]:
        x = torch.randn(shape)
        torch.testing.assert_close(model[0](x), ref[0](x), atol=1e-4, rtol=1e-4)
        assert model[0](x).shape == (*shape[:-1], 8192)


def test_the_probe_decides_and_only_large_layers_switch(monkeypatch):
    model = _model()
    monkeypatch.setattr(linear, "_few_rows_faster", lambda weight: False)
    assert linear.use_few_row_linear(model) == 0 and type(model[0]) is nn.Linear
    monkeypatch.setattr(linear, "_few_rows_faster", lambda weight: weight.shape == (8192, 512))
    assert linear.use_few_row_linear(model) == 1
    assert type(model[0]) is linear.FewRowLinear and type(model[1]) is nn.Linear
    assert list(dict(model.named_parameters())) == ["0.weight", "0.bias", "1.weight", "1.bias"]

"""A device setting the machine cannot honour is one line naming the value and the fix.

GPU presence is simulated (torch's build and device queries are patched), so every case runs on
any machine.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.worker.model_runner import resolve_device

CPU_ONLY = "CUDA requested but this torch build is CPU-only: use --device cpu or install a CUDA build of torch"


@pytest.fixture
def cpu_only_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize("name", [None, "auto", "AUTO"])
def test_auto_is_cpu_without_a_gpu(cpu_only_build, name):
    assert resolve_device(name) == torch.device("cpu")


@pytest.mark.parametrize("name, expected", [(None, "cuda"), ("cpu", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda:1"),
                                            (" CUDA:0 ", "cuda:0")])
def test_usable_devices(two_gpus, name, expected):
    assert resolve_device(name) == torch.device(expected)


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_on_a_cpu_only_build(cpu_only_build, name):
    with pytest.raises(ValueError) as info:
        resolve_device(name)
    assert str(info.value) == CPU_ONLY


def test_cuda_build_without_a_usable_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda': no CUDA GPU is usable .*: use --device cpu"):
        resolve_device("cuda")


def test_gpu_index_past_the_visible_gpus(two_gpus):
    with pytest.raises(ValueError) as info:
        resolve_device("cuda:3")
    assert str(info.value) == "device 'cuda:3': this process sees 2 GPUs (cuda:0 to cuda:1): use one of them " \
                              "or --device cpu"


@pytest.mark.parametrize("name, reason", [("mps", "(mps) is not supported"), ("xpu", "(xpu) is not supported"),
                                          ("meta", "(meta) is not supported"), ("gpu", "is not a device"),
                                          ("cuda:x", "is not a device"), ("", "is not a device")])
def test_other_strings(name, reason):
    with pytest.raises(ValueError) as info:
        resolve_device(name)
    assert str(info.value).startswith(f"device {name!r} {reason}: use auto, cpu, cuda or cuda:N")


def _cli_error(capsys, *argv) -> list[str]:
    from deepinfer.entrypoints.cli import main

    capsys.readouterr()  # drop what building the checkpoint printed
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    return captured.err.splitlines()


def test_cli_cuda_on_a_cpu_only_build(cpu_only_build, tiny_checkpoint, capsys):
    lines = _cli_error(capsys, "generate", "--model", tiny_checkpoint("llama"), "--device", "cuda", "hi")
    assert lines == [f"deepinfer: error: {CPU_ONLY}"]


def test_cli_gpu_index_past_the_visible_gpus(two_gpus, tiny_checkpoint, capsys):
    lines = _cli_error(capsys, "generate", "--model", tiny_checkpoint("llama"), "--device", "cuda:3", "hi")
    assert len(lines) == 1 and lines[0].startswith("deepinfer: error: device 'cuda:3': this process sees 2 GPUs")


@pytest.mark.parametrize("name", ["mps", "xpu", "tpu"])
def test_cli_other_devices(name, tiny_checkpoint, capsys):
    lines = _cli_error(capsys, "generate", "--model", tiny_checkpoint("llama"), "--device", name, "hi")
    assert len(lines) == 1 and lines[0].startswith(f"deepinfer: error: device {name!r}")


def test_llm_device_raises_value_error(cpu_only_build, tiny_checkpoint):
    from deepinfer import LLM

    with pytest.raises(ValueError, match="CPU-only"):
        LLM(tiny_checkpoint("llama"), device="cuda", num_blocks=16)
    with pytest.raises(ValueError, match=r"device 'mps' \(mps\) is not supported"):
        LLM(tiny_checkpoint("llama"), device="mps", num_blocks=16)

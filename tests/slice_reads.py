"""Which checkpoint tensors a tensor-parallel rank reads whole and which it reads as slices."""

from __future__ import annotations


def spy_slice_reads(monkeypatch=None) -> dict[str, list[str]]:
    """From now on, the names of safetensors tensors this process reads whole ("read") or sliced
    ("narrow"), by wrapping loader/hf.iter_safetensors_slices (undone after the test when
    `monkeypatch` is given; for good in a spawned rank process otherwise)."""
    from deepinfer.model_executor.loader import hf

    reads: dict[str, list[str]] = {"read": [], "narrow": []}
    inner = hf.iter_safetensors_slices

    def spied(files, dtype):
        for name, lazy in inner(files, dtype):
            read, narrow = lazy.read, lazy.narrow
            lazy.read = lambda read=read, name=name: (reads["read"].append(name), read())[1]
            lazy.narrow = lambda *a, narrow=narrow, name=name: (reads["narrow"].append(name), narrow(*a))[1]
            yield name, lazy

    if monkeypatch is None:
        hf.iter_safetensors_slices = spied
    else:
        monkeypatch.setattr(hf, "iter_safetensors_slices", spied)
    return reads

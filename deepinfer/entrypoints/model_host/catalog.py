"""The models a model host lists, by name, and what can be told of each without loading it.

    --models-dir DIR   every GGUF file in DIR (searched recursively) by its stem, a split set once by
                       its first part's stem without `-00001-of-0000N`, and every folder holding a
                       config.json (an HF checkpoint) by the folder's name
    --model M          each one given (the flag may repeat), named as `deepinfer serve --model M` names it
    --all-models       what `deepinfer list` shows: pip-shipped models, the Hugging Face cache, the models dir

A name is taken by the first model that claims it, in that order; a later one with the same name is
skipped with a log line naming both. A request may also name a model `NAME:latest` (Ollama's way).

The facts (`ModelFacts`: parameter count, family, quantization, context length, chat template) come
from the file's header (a GGUF's metadata and tensor table, or an HF folder's config.json and
safetensors headers), read once per file on first use: listing a hundred models maps no weights.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import threading

logger = logging.getLogger("deepinfer.server")
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})$")
_LATEST = ":latest"


@dataclasses.dataclass(frozen=True)
class HostedModel:
    """One listed model: the name clients send, what `--model` loads it from, its files' bytes."""

    name: str
    path: str  # a GGUF file (a split set's first part), an HF folder, or a name `--model` resolves
    size: int
    modified: float
    source: str  # models-dir | model | pip | hf-cache


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What /api/tags and /api/show tell of a model that is not loaded."""

    parameter_count: int | None = None
    family: str = ""
    quantization: str = ""
    context_length: int | None = None
    chat_template: str = ""
    pooling: bool = False  # it declares a pooling (an embedding model)


def parameter_size(count: int | None) -> str:
    """A parameter count as Ollama writes it ("494.03M", "7.62B"); "" when unknown."""
    if count is None:
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(count)


class Catalog:
    """The listed models by name (thread-safe: pulls and deletes change it while routes read it)."""

    def __init__(self, models: list[HostedModel]):
        self._lock = threading.Lock()
        self._by_name: dict[str, HostedModel] = {}
        self._facts: dict[str, ModelFacts] = {}
        for model in models:
            self.add(model)

    def add(self, model: HostedModel) -> bool:
        """List `model`; False (and a log line) when its name is taken."""
        with self._lock:
            taken = self._by_name.get(model.name)
            if taken is not None:
                if taken.path != model.path:
                    logger.warning("model name %r is taken by %s; %s is not listed", model.name, taken.path,
                                   model.path)
                return False
            self._by_name[model.name] = model
            return True

    def remove(self, name: str) -> HostedModel | None:
        with self._lock:
            self._facts.pop(name, None)
            return self._by_name.pop(name, None)

    def find(self, name: str | None) -> HostedModel | None:
        """The model `name` or `name:latest` names; None when none."""
        if not name:
            return None
        with self._lock:
            return self._by_name.get(name) or self._by_name.get(name.removesuffix(_LATEST))

    def all(self) -> list[HostedModel]:
        with self._lock:
            return sorted(self._by_name.values(), key=lambda m: m.name.lower())

    def facts(self, model: HostedModel) -> ModelFacts:
        """The model's facts, read from its files once (empty facts when they cannot be read)."""
        with self._lock:
            known = self._facts.get(model.name)
        if known is None:
            try:
                known = read_facts(model.path)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("cannot read the facts of model %r (%s): %s", model.name, model.path, exc)
                known = ModelFacts()
            with self._lock:
                self._facts[model.name] = known
        return known


def build_catalog(models_dir: str | None, models: list[str], all_models: bool) -> Catalog:
    """The catalog of the three sources (module docstring), in order; a --models-dir that is not a
    directory is a ValueError naming it."""
    found = []
    if models_dir is not None:
        found += dir_models(models_dir)
    found += [given_model(m) for m in models]
    if all_models:
        found += listed_models(models_dir)
    return Catalog(found)


def dir_models(models_dir: str) -> list[HostedModel]:
    """The GGUF files and HF folders under `models_dir` (module docstring)."""
    root = os.path.abspath(os.path.expanduser(models_dir))
    if not os.path.isdir(root):
        raise ValueError(f"--models-dir {models_dir!r} is not a directory")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        if "config.json" in files and folder != root:
            found.append(_folder_model(folder))
            dirs.clear()  # a checkpoint's own subfolders hold no other model
            continue
        for name in sorted(files):
            model = _gguf_model(os.path.join(folder, name))
            if model is not None:
                found.append(model)
    return found


def _gguf_model(path: str) -> HostedModel | None:
    """A GGUF file as a model: a whole file or a split set's first part; None for anything else."""
    if not path.lower().endswith(".gguf") or not os.path.isfile(path):
        return None
    stem = os.path.basename(path)[:-len(".gguf")]
    split = _SPLIT.match(stem)
    if split is not None and int(split["no"]) != 1:
        return None  # a later part: listed with its first
    files = [path] if split is None else _split_files(path, split)
    stats = [os.stat(f) for f in files if os.path.isfile(f)]
    return HostedModel(split["stem"] if split else stem, path, sum(s.st_size for s in stats),
                       max(s.st_mtime for s in stats), "models-dir")


def _split_files(path: str, split: re.Match) -> list[str]:
    count, folder = int(split["count"]), os.path.dirname(path)
    return [os.path.join(folder, f"{split['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _folder_model(folder: str) -> HostedModel:
    files = [os.path.join(folder, f) for f in os.listdir(folder)]
    stats = [os.stat(f) for f in files if os.path.isfile(f)]
    return HostedModel(os.path.basename(folder), folder, sum(s.st_size for s in stats),
                       max((s.st_mtime for s in stats), default=0.0), "models-dir")


def given_model(model: str) -> HostedModel:
    """A --model value as a listed model, named as `deepinfer serve --model` names it."""
    from argparse import Namespace

    from deepinfer.entrypoints.openai.args import served_model_name

    name = served_model_name(Namespace(served_model_name=None, model=model))
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        found = _gguf_model(os.path.abspath(path))
        if found is not None:
            return dataclasses.replace(found, name=name, source="model")
    if os.path.isdir(path):
        return dataclasses.replace(_folder_model(os.path.abspath(path)), name=name, source="model")
    return HostedModel(name, model, 0, 0.0, "model")  # a short or Hub name: --model resolves it


def listed_models(models_dir: str | None) -> list[HostedModel]:
    """What `deepinfer list` shows, each named as `deepinfer serve --model` would name it."""
    from deepinfer.entrypoints.models_cmd.inventory import SOURCE_DIR, SOURCE_PIP, list_models

    found = []
    for entry in list_models(models_dir).entries:
        if entry.source == SOURCE_DIR:
            model = _gguf_model(entry.path)
            if model is not None:
                found.append(model)
            continue
        path = entry.name if entry.source == SOURCE_PIP else entry.path
        name = entry.name.rsplit("/", 1)[-1].removesuffix(".gguf") if entry.name.endswith(".gguf") else entry.name
        found.append(HostedModel(name, path, entry.size, entry.modified, entry.source))
    return found


def read_facts(path: str) -> ModelFacts:
    """A model's facts from its files' headers (a GGUF, or an HF folder); empty for a name."""
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        return _gguf_facts(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return _folder_facts(path)
    return ModelFacts()


def _gguf_facts(path: str) -> ModelFacts:
    from deepinfer.model_executor.loader.gguf_file import read_gguf_file

    gguf = read_gguf_file(path)
    meta, arch = gguf.metadata, str(gguf.metadata.get("general.architecture", ""))
    count = sum(math.prod(t.shape) for t in gguf.tensors)
    types = {t.tensor_type.name for t in gguf.tensors if len(t.shape) > 1}
    file_type = _FILE_TYPES.get(meta.get("general.file_type"))
    quant = file_type or (sorted(types)[0] if len(types) == 1 else "")
    template = meta.get("tokenizer.chat_template")
    return ModelFacts(count, arch, quant, meta.get(f"{arch}.context_length"),
                      template if isinstance(template, str) else "", meta.get(f"{arch}.pooling_type") in _POOLINGS)


_POOLINGS = (1, 2, 3)  # llama.cpp's pooling types mean, cls, last (0: none; 4: rank, not an embedding)


# llama.cpp's LLAMA_FTYPE values of the common files (general.file_type)
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
               17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
               23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
               29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4"}


def _folder_facts(folder: str) -> ModelFacts:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    count = sum(_safetensors_count(os.path.join(folder, n)) for n in sorted(os.listdir(folder))
                if n.endswith(".safetensors"))
    template = ""
    tokenizer_config = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(tokenizer_config):
        with open(tokenizer_config, encoding="utf-8") as f:
            found = json.load(f).get("chat_template")
        template = found if isinstance(found, str) else ""
    quant = (config.get("quantization_config") or {}).get("quant_method", "")
    return ModelFacts(count or None, str(config.get("model_type", "")), str(quant).upper() or
                      str(config.get("torch_dtype", "")).upper(), config.get("max_position_embeddings"), template,
                      os.path.isfile(os.path.join(folder, "modules.json")))


def _safetensors_count(path: str) -> int:
    """The number of values in a safetensors file, from its header alone."""
    from safetensors import safe_open

    with safe_open(path, "np") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())

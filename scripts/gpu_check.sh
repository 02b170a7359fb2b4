#!/usr/bin/env bash
# A self-contained check of trikv on one accelerator, needing only torch (CUDA build on a GPU) and transformers:
# no vLLM, no model download. Page codec in vLLM 0.32's six KV cache layouts (bitwise); serving compaction rounds at
# 8B-model shapes (32 layers, 8 KV heads, head_dim 128: 64 requests due, first rounds of 32K / 64K / 128K prompts)
# with their chunk plan, peak memory against round_workspace_bytes, time, host-device synchronisations and a GPU
# time estimate; trikv's transformers cache and lean engine on a small random model. Prints a JSON report; exits
# non-zero when a check fails. A few minutes on one H200-class GPU.
#
# usage: scripts/gpu_check.sh [--device cuda|cpu] [--small] [--host-fit [--host-cache-bytes N]] [--workspace BYTES]
#                             [--rounds due-64,first-32K,...] [--skip-transformers] [--out report.json] [--page PAGE.md]
#   --host-fit   the 8B rounds over block tables that share at most 2 GiB of cache: runs on a 24 GiB host
#                (scripts/gpu_check.sh --device cpu --host-fit: ~20 min on 2 cores)
#   --page       writes the round figures into that page's gpu-check block (docs/vllm-cuda.md)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then python=.venv/bin/python; fi
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m trikv.benchmarks.gpu_check "$@"

#!/usr/bin/env bash
# Set up, then run the test suite at both ends of trikv's transformers range (what CI runs):
#   .venv         vLLM 0.32 (CPU build here) + transformers 5.19 (vLLM's pin): every test, the vLLM ones included
#   .venv-upper   transformers 5.24 (the newest release in the range) + MLX's CPU build and mlx-lm, no vLLM: every test
#                 that touches transformers, and trikv's MLX caches against the torch path (tests/test_mlx.py)
# Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-vllm
TRIKV_VENV=.venv-upper TRIKV_TRANSFORMERS="transformers>=5.24,<5.25" bash scripts/setup.sh --with-mlx
status=0
echo "== transformers $(.venv/bin/python -c 'import transformers; print(transformers.__version__)') + vLLM $(.venv/bin/python -c 'import vllm; print(vllm.__version__)')"
TRIKV_REQUIRE_VLLM=1 .venv/bin/python -m pytest -q tests "$@" || status=1
# the upper end runs the tests that exercise transformers (caches, attention, calibration, engines, inputs);
# the benchmark-plumbing tests (analysis, quality, speed) and the slow Gemma-3 end-to-end ones run once, above
echo "== transformers $(.venv-upper/bin/python -c 'import transformers; print(transformers.__version__)') + mlx $(.venv-upper/bin/python -c 'import mlx.core; print(mlx.core.__version__)')"
TRIKV_REQUIRE_MLX=1 .venv-upper/bin/python -m pytest -q -m "not vllm" tests/test_mlx.py tests/test_cache_exactness.py tests/test_real_model.py tests/test_baselines.py \
    tests/test_compaction.py tests/test_lean.py tests/test_bad_input.py tests/test_kept_sets.py tests/test_geometry_calibration.py \
    tests/test_scoring.py -k "not gemma3_demo and not gemma3_shipped_statistics and not gemma3_fidelity" "$@" || status=1
exit $status

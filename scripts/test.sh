#!/usr/bin/env bash
# Set up, then run the test suite at both ends of trikv's transformers range (what CI runs):
#   .venv         vLLM 0.32 (CPU build here) + transformers 5.19 (vLLM's pin): every test but the few below
#   .venv-upper   transformers 5.24 (the newest release in the range) + MLX's CPU build and mlx-lm, no vLLM: every test
#                 that exercises transformers again, trikv's MLX caches against the torch path (tests/test_mlx.py), and
#                 two sets that run once, here to even out the two suites' times: every command and snippet of the
#                 README (tests/test_readme.py; it runs the README's vLLM commands with .venv's interpreter) and the
#                 slow Gemma-3 end-to-end tests
# The two venvs are set up, and their suites run, side by side (TRIKV_TEST_SERIAL=1: one after the other; each
# suite then runs torch on one thread per process, as two busy processes share the 2 cores anyway); the upper
# suite's output follows the first one's. Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
upper_log=$(mktemp)
trap 'rm -f "$upper_log"' EXIT
setup_upper() { TRIKV_VENV=.venv-upper TRIKV_TRANSFORMERS="transformers>=5.24,<5.25" bash scripts/setup.sh --with-mlx; }
if command -v flock >/dev/null 2>&1; then  # setup.sh takes turns on the editable install through flock
    setup_upper > "$upper_log" 2>&1 &
    upper_setup=$!
    bash scripts/setup.sh --with-vllm
    if ! wait $upper_setup; then
        cat "$upper_log"
        echo "setting up .venv-upper failed" >&2
        exit 1
    fi
else
    bash scripts/setup.sh --with-vllm
    setup_upper
fi
ONCE=(tests/test_readme.py)
GEMMA_ONCE="gemma3_demo or gemma3_shipped_statistics or gemma3_fidelity"
run_upper() {
    echo "== transformers $(.venv-upper/bin/python -c 'import transformers; print(transformers.__version__)') + mlx $(.venv-upper/bin/python -c 'import mlx.core; print(mlx.core.__version__)')"
    TRIKV_REQUIRE_MLX=1 .venv-upper/bin/python -m pytest -q -p no:cacheprovider -m "not vllm" tests/test_mlx.py \
        tests/test_cache_exactness.py tests/test_real_model.py tests/test_baselines.py tests/test_compaction.py tests/test_lean.py \
        tests/test_bad_input.py tests/test_kept_sets.py tests/test_geometry_calibration.py tests/test_scoring.py \
        tests/test_model_inputs.py "${ONCE[@]}" -k "not known_prompt and not without_its_bos and not refresh" "$@"
}
status=0
if [ "${TRIKV_TEST_SERIAL:-0}" = 1 ]; then
    upper_status_file=""
else
    export TRIKV_TEST_THREADS=1
    upper_status_file=$(mktemp)
    (run_upper "$@" > "$upper_log" 2>&1; echo $? > "$upper_status_file") &
    upper_run=$!
fi
echo "== transformers $(.venv/bin/python -c 'import transformers; print(transformers.__version__)') + vLLM $(.venv/bin/python -c 'import vllm; print(vllm.__version__)')"
TRIKV_REQUIRE_VLLM=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests "${ONCE[@]/#/--ignore=}" -k "not ($GEMMA_ONCE)" "$@" \
    || status=1
if [ -z "$upper_status_file" ]; then
    run_upper "$@" || status=1
else
    wait $upper_run || true
    cat "$upper_log"
    [ "$(cat "$upper_status_file")" = 0 ] || status=1
    rm -f "$upper_status_file"
fi
exit $status

#!/usr/bin/env bash
# Set up, then run the test suite at both ends of trikv's transformers range (what CI runs):
#   .venv         vLLM 0.32 (CPU build here) + transformers 5.19 (vLLM's pin): every test but the few below
#   .venv-upper   transformers 5.24 (the newest release in the range) + MLX's CPU build and mlx-lm, no vLLM: the
#                 exactness tests again (tiny models on every architecture, the bundled model without eviction; the
#                 README lane runs the CLI's generate and calibrate), trikv's MLX caches against the torch path
#                 (tests/test_mlx.py), and every command and snippet of the README and the guides
#                 (tests/test_readme.py, once; it runs the vLLM commands with .venv's interpreter)
# Two tiers:
#   bash scripts/test.sh          every guarantee once, on the bundled SmolLM2-135M and tiny random models (what CI runs)
#   bash scripts/test.sh --full   also the tests marked `extended` (pyproject.toml says what they are: the other real
#                                 models, the upper end's repeats of the selection and engine tests, vLLM's
#                                 multi-process setups, benchmark pipelines beyond the README's own commands)
# The two venvs are set up side by side; the tests then run in five lanes at once (the .venv suite split into
# tests/test_vllm.py and the rest; the upper suite; the README's commands; its snippets), one torch thread per process
# (TRIKV_TEST_THREADS=1, which the tests hand on to the processes they start as OMP_NUM_THREADS); TRIKV_TEST_SERIAL=1
# runs the lanes one after the other at torch's default threads. Each lane's output is printed in turn. Extra
# arguments go to every pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
full=0
if [ "${1:-}" = "--full" ]; then
    full=1
    shift
fi
# the tests each lane selects: `extended` ones only with --full
tier() { if [ $full = 1 ]; then echo "${1:-}"; else echo "${1:+$1 and }not extended"; fi; }
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
# the upper end repeats the selection and engine tests (tiny models) only with --full
UPPER_FULL=()
if [ $full = 1 ]; then
    UPPER_FULL=(tests/test_baselines.py tests/test_compaction.py tests/test_lean.py tests/test_kept_sets.py tests/test_model_inputs.py)
fi
run_upper() {
    echo "== transformers $(.venv-upper/bin/python -c 'import transformers; print(transformers.__version__)') + mlx $(.venv-upper/bin/python -c 'import mlx.core; print(mlx.core.__version__)')"
    TRIKV_REQUIRE_MLX=1 .venv-upper/bin/python -m pytest -q -p no:cacheprovider -m "$(tier "not vllm")" tests/test_mlx.py \
        tests/test_cache_exactness.py tests/test_real_model.py tests/test_bad_input.py tests/test_geometry_calibration.py \
        tests/test_scoring.py "${UPPER_FULL[@]}" \
        -k "not known_prompt and not without_its_bos and not refresh and not generate_command and not calibrate_command \
and not left_padded_batch_equals_rows_alone_on_real_model and not eviction_equals_masking_on_real_model \
and not gemma3_no_eviction" "$@"
}
run_readme() {  # the README's and the guides' commands ("commands") or snippets ("snippets"), in .venv-upper (each
    # names the venv it needs); a snippet that reads a file a command writes runs that command itself
    local part="not snippet"
    [ "$1" = snippets ] && part="snippet"
    shift
    echo "== README and guides ($part): transformers $(.venv-upper/bin/python -c 'import transformers; print(transformers.__version__)')"
    TRIKV_REQUIRE_MLX=1 .venv-upper/bin/python -m pytest -q -p no:cacheprovider -m "$(tier)" -k "$part" "${ONCE[@]}" "$@"
}
run_venv() {  # the .venv suite, in two parts: "vllm" (tests/test_vllm.py) or "rest" (every other module)
    local part=(tests/test_vllm.py)
    [ "$1" = rest ] && part=(tests "--ignore=tests/test_vllm.py")
    shift
    echo "== transformers $(.venv/bin/python -c 'import transformers; print(transformers.__version__)') + vLLM $(.venv/bin/python -c 'import vllm; print(vllm.__version__)')"
    TRIKV_REQUIRE_VLLM=1 .venv/bin/python -m pytest -q -p no:cacheprovider -m "$(tier)" "${part[@]}" "${ONCE[@]/#/--ignore=}" \
        -k "not ($GEMMA_ONCE)" "$@"
}
lanes=("run_venv vllm" "run_venv rest" "run_upper" "run_readme commands" "run_readme snippets")
status=0
if [ "${TRIKV_TEST_SERIAL:-0}" = 1 ]; then
    for lane in "${lanes[@]}"; do
        $lane "$@" || status=1
    done
    exit $status
fi
# five lanes side by side, one torch thread each, none much longer than the others (the README's commands and its
# snippets split: one lane for both would end last), so that both cores stay busy until the end; each lane has its
# own pytest base folder
export TRIKV_TEST_THREADS=1
work=$(mktemp -d)
trap 'rm -f "$upper_log"; rm -rf "$work"' EXIT
pids=()
for index in "${!lanes[@]}"; do
    (${lanes[$index]} "$@" --basetemp "$work/tmp$index" > "$work/log$index" 2>&1; echo $? > "$work/status$index") &
    pids+=($!)
done
for index in "${!lanes[@]}"; do
    wait "${pids[$index]}" || true
    cat "$work/log$index"
    [ "$(cat "$work/status$index" 2>/dev/null)" = 0 ] || status=1
done
exit $status

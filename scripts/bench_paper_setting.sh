#!/usr/bin/env bash
# The paper's setting on one CUDA GPU: a reasoning model, AIME 2024 + 2025, 8 samples per problem (T 0.6, top-p 0.95),
# up to 32K new tokens, budget 2048; full attention, TriAttention, the pre-registered triattention-dedup, R-KV and SnapKV under
# one rule (the same trigger, prompt protection, budget accounting and dtype). Not run on the CPU machine trikv is
# developed on: no reasoning model ships there and 32K-token generations of a 7B model need a GPU.
#
# Usage:
#   bash scripts/bench_paper_setting.sh [MODEL] [BUDGET]
#   bash scripts/bench_paper_setting.sh --help
#   MODEL:  a hub id or local folder (default deepseek-ai/DeepSeek-R1-Distill-Qwen-7B, one of the paper's models)
#   BUDGET: KV entries per layer and head (default 2048)
#
# Three steps, each resumable: (1) the model's own reasoning on MATH-500 rows 250-297 as calibration text (the rows
# the math evaluation skips), (2) its pre-RoPE query statistics, (3) the accuracy run, then its report page.
# Expect hours on an H100/H200: 60 problems x 8 samples x 5 methods, answers of up to 32K tokens.
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  -*) echo "bench_paper_setting.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
. .venv/bin/activate
model=${1:-deepseek-ai/DeepSeek-R1-Distill-Qwen-7B}
budget=${2:-2048}
name=$(basename "$model" | tr '[:upper:]' '[:lower:]')
out=runs/paper-setting/$name
mkdir -p "$out"
# the methods of the latest pre-registered test (full, triattention, triattention-dedup, rkv, snapkv)
methods=$(python -c "import json; print(','.join(json.load(open('docs/preregistration.json'))['tests'][-1]['methods']))")

# 1. calibration text: 48 full-attention reasoning traces of up to 8K tokens (the paper calibrates on such traces)
if [ ! -s "$out/calibration.txt" ]; then
  python scripts/make_calibration_text.py --model "$model" --count 48 --batch 16 --new-tokens 8192 \
    --device cuda --dtype bfloat16 --engine transformers --out "$out/calibration.txt"
fi
# 2. statistics (float64 sums; 200K tokens of the traces)
if [ ! -s "$out/stats.safetensors" ]; then
  trikv calibrate --model "$model" --text-file "$out/calibration.txt" --out "$out/stats.safetensors" \
    --text-tokens 200000 --chunk-tokens 4096 --device cuda --dtype bfloat16
fi
# 3. accuracy on AIME 2024 + 2025 (the run resumes: rerun the script to continue after an interruption)
trikv bench quality --task math --model "$model" --stats "$out/stats.safetensors" --math-datasets aime24,aime25 \
  --samples 8 --temperature 0.6 --max-new-tokens 32768 --budgets "$budget" --math-batch 32 --math-engine lean \
  --methods "$methods" --device cuda --dtype bfloat16 --no-progress --out "$out/aime"
trikv bench report "$out/aime" --out "$out/results.md"
echo "report: $out/results.md"

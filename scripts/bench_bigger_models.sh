#!/usr/bin/env bash
# The quality runs on the bigger offline models behind docs/results.md (resumable: rerun to continue).
# Statistics: scripts/make_calibration_text.py --model M then `trikv calibrate` (shipped in src/trikv/data/stats).
# Times on 2 CPU cores, one thread per run: ~45 min for the 0.5B fidelity grid, ~50 min for the 1.5B one
# (both at once).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
common=(--task fidelity --texts python-reference,math-solutions --text-tokens 4096 --horizons 128,512,1024,2048
        --recall-stride 8 --threads 1 --no-progress)
trikv bench quality "${common[@]}" --model qwen2.5-coder-0.5b --budgets 128,410 \
  --methods full,triattention,triattention-window,triattention-recent,snapkv,rkv,h2o,streaming \
  --out runs/quality/qwen2.5-coder-0.5b-fidelity
trikv bench quality "${common[@]}" --model qwen2.5-coder-1.5b --budgets 410 \
  --methods full,triattention,triattention-window,snapkv,rkv,h2o,streaming \
  --out runs/quality/qwen2.5-coder-1.5b-fidelity
trikv bench report runs/quality-quick runs/quality/qwen2.5-coder-0.5b-fidelity runs/quality/qwen2.5-coder-1.5b-fidelity \
  --out docs/results.md

#!/usr/bin/env bash
# The quality runs behind docs/results.md, step by step (each resumable: rerun a step to continue it), then the
# earlier runs behind docs/results-earlier.md (made before the equal prompt-protection rule; kept for their commands).
#
# Usage:
#   bash scripts/bench_bigger_models.sh [--ship] [STEP ...]      (no STEP: every step of docs/results.md, in order)
#   bash scripts/bench_bigger_models.sh --help
#
# Steps: traces gemma3 heldout2 fidelity heldout1 design report analysis earlier
#   traces    every shipped trace set judged again under the validity rule (digits masked, thresholds from human
#             text), then the invalid traces written again from fresh seeds, the valid ones kept (SmolLM2's five
#             counting loops: ~35 min at one thread beside two other jobs; Gemma-3's one: see the gemma3 step;
#             the 0.5B's seven: ~1.5 h; the 1.5B's two design traces: ~1 h)
#   gemma3    Gemma-3-270M's calibration text, statistics and evaluation traces (BOS, plain completion prompts,
#             Gemma's recommended sampling T 1.0, top-k 64, top-p 0.95: ~2 h at one thread beside another job)
#   heldout2  the second pre-registered test (docs/preregistration.json, heldout-2): B = 128 then 256 (~72 min a
#             cell at two threads: the two missing B = 128 cells ~2.4 h, the four B = 256 cells ~4.8 h)
#   fidelity  fidelity and recall on each model's valid evaluation traces, the whole field, B = 128 (~0.5-1.5 h each)
#   heldout1  the first pre-registered test again (rows 300-399, B = 128, ~3 h), for its section and the pooled figure
#             (both held-out steps keep their answers in docs/runs/ after every chunk and resume from that copy)
#   design    the diagnosis on the 1.5B's design traces (~25 min)
#   report    docs/results.md from the run folders (results.json kept in docs/runs/ so the page can be rebuilt)
#   analysis  Q/K concentration of every bundled model -> docs/runs/analysis, docs/analysis.md (~15 min)
#   earlier   every run behind docs/results-earlier.md (many hours)
# Steps `traces` and `gemma3` rewrite files trikv ships (src/trikv/data, src/trikv/benchmarks/quality/data): they
# refuse to run without --ship. Times are for 2 CPU cores, one job at a time, two threads.
set -euo pipefail
cd "$(dirname "$0")/.."
SHIP=0
STEPS=()
for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --ship) SHIP=1 ;;
    traces|gemma3|heldout2|fidelity|heldout1|design|report|analysis|earlier) STEPS+=("$arg") ;;
    *) echo "bench_bigger_models.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#STEPS[@]} -gt 0 ] || STEPS=(traces gemma3 heldout2 fidelity heldout1 design report analysis)
. .venv/bin/activate
wants() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }
needs_ship() {
  if [ "$SHIP" != 1 ]; then
    echo "step $1 rewrites files trikv ships; run it with --ship" >&2
    exit 2
  fi
}
keep() {  # the run's results.json and plots beside the page, so docs/results.md can be rebuilt without runs/
  mkdir -p "docs/runs/$(basename "$1")"
  cp "$1/results.json" "$1"/*.png "docs/runs/$(basename "$1")/" 2>/dev/null || true
}
keep_answers() {  # a math run's config and answers (units/*.json) too, after every chunk: they are the raw data a
  # reviewer checks, and a machine that loses runs/ resumes from them (restore_answers)
  keep "$1"
  mkdir -p "docs/runs/$(basename "$1")/units"
  cp "$1/config.json" "docs/runs/$(basename "$1")/"
  cp "$1"/units/*.json "docs/runs/$(basename "$1")/units/"
}
restore_answers() {  # a run folder absent from runs/ starts from the kept copy of its answers
  if [ ! -d "$1/units" ] && [ -d "docs/runs/$(basename "$1")/units" ]; then
    mkdir -p "$1/units"
    cp "docs/runs/$(basename "$1")/config.json" "$1/"
    cp "docs/runs/$(basename "$1")"/units/*.json "$1/units/"
    echo "resuming $1 from docs/runs/$(basename "$1")"
  fi
}

# ---- docs/results.md ------------------------------------------------------------------------------------------
if wants traces; then
  needs_ship traces
  for split in "smollm2-135m evaluation" "gemma3-270m evaluation" "qwen2.5-coder-0.5b evaluation" \
               "qwen2.5-coder-1.5b evaluation" "qwen2.5-coder-1.5b design"; do
    set -- $split
    python -m trikv.benchmarks.quality.traces --model $1 --split $2 --assess --ship   # the text stays, the verdict is new
  done
  python -m trikv.benchmarks.quality.traces --model smollm2-135m --split evaluation --redo-invalid --threads 2 --ship
  python -m trikv.benchmarks.quality.traces --model gemma3-270m --split evaluation --engine transformers \
    --temperature 1.0 --top-k 64 --top-p 0.95 --redo-invalid --threads 2 --ship
  python -m trikv.benchmarks.quality.traces --model qwen2.5-coder-0.5b --split evaluation --dtype bfloat16 --redo-invalid --threads 2 --ship
  python -m trikv.benchmarks.quality.traces --model qwen2.5-coder-1.5b --split design --dtype bfloat16 --redo-invalid --threads 2 --ship
fi
if wants gemma3; then
  needs_ship gemma3
  TRIKV_THREADS=2 python scripts/make_calibration_text.py --model gemma3-270m --count 16 --engine transformers --ship
  trikv calibrate --model gemma3-270m --text-file src/trikv/data/calibration/gemma3-270m-math500-traces.txt \
    --out src/trikv/data/stats/gemma3-270m.safetensors
  python -m trikv.benchmarks.quality.traces --model gemma3-270m --split evaluation --engine transformers \
    --temperature 1.0 --top-k 64 --top-p 0.95 --threads 2 --ship
fi
if wants heldout2; then
  # Every cell computes at two threads and records its fingerprint (commit, threads, inputs); a cell whose fingerprint
  # differs from the invocation's is computed again. The three B = 128 cells finished before cells recorded one
  # (triattention, rkv, triattention-dedup) are reused as they are (--reuse-unrecorded) and the page says their commit
  # and thread count were not recorded: computing them again would take ~3.6 h and could change bf16 answers.
  heldout2=$(python -c "print(','.join(f'math500-{i}' for i in [*range(137, 200), *range(433, 500)]))")
  restore_answers runs/quality/qwen2.5-coder-1.5b-heldout2
  budgets=""
  for budget in 128 256; do
    budgets="${budgets:+$budgets,}$budget"
    for methods in "triattention rkv" "full triattention-dedup snapkv"; do
      for end in 32 64 96 128 130; do
        for method in $methods; do
          [ "$method" = full ] && [ "$budget" = 256 ] && continue  # full attention does not depend on the budget
          trikv bench quality --task math --model qwen2.5-coder-1.5b --budgets $budget --samples 1 --math-batch 32 \
            --temperature 0 --max-new-tokens 1024 --problems "$(echo "$heldout2" | cut -d, -f1-$end)" \
            --dtype bfloat16 --threads 2 --no-progress --reuse-unrecorded --out runs/quality/qwen2.5-coder-1.5b-heldout2 \
            --methods $method
          keep_answers runs/quality/qwen2.5-coder-1.5b-heldout2
        done
      done
    done
    # every finished cell in one results.json (nothing is computed again), which the report reads
    trikv bench quality --task math --model qwen2.5-coder-1.5b --budgets $budgets --samples 1 --math-batch 32 \
      --temperature 0 --max-new-tokens 1024 --problems "$heldout2" --dtype bfloat16 --threads 2 --no-progress \
      --reuse-unrecorded --out runs/quality/qwen2.5-coder-1.5b-heldout2 --methods full,triattention,triattention-dedup,rkv,snapkv
    keep_answers runs/quality/qwen2.5-coder-1.5b-heldout2
  done
fi
field=full,triattention,triattention-shared-layers,triattention-window,triattention-recent,triattention-dedup,rkv,snapkv,snapkv-decode,h2o,streaming,tova,tam-shared
traces=(--task fidelity --traces evaluation --horizons 128,512,1024 --recall-stride 8 --threads 2 --no-progress --methods $field --budgets 128)
if wants fidelity; then
  # a folder's cells are reused only where their fingerprint (trace text, statistics, code, threads) matches; the
  # runs behind the page took 29 min (1.5B), 28 min (SmolLM2) and 67 min (Gemma-3) at two threads, one job at a time
  trikv bench quality "${traces[@]}" --model qwen2.5-coder-1.5b --dtype bfloat16 --out runs/quality/qwen2.5-coder-1.5b-traces
  trikv bench quality "${traces[@]}" --model smollm2-135m --out runs/quality/smollm2-135m-traces
  trikv bench quality "${traces[@]}" --model gemma3-270m --out runs/quality/gemma3-270m-traces
  trikv bench quality "${traces[@]}" --model qwen2.5-coder-0.5b --dtype bfloat16 --out runs/quality/qwen2.5-coder-0.5b-traces
  for run in qwen2.5-coder-1.5b smollm2-135m gemma3-270m qwen2.5-coder-0.5b; do keep runs/quality/$run-traces; done
fi
if wants heldout1; then
  restore_answers runs/quality/qwen2.5-coder-1.5b-heldout
  candidate=$(python -c "import json; print(json.load(open('docs/preregistration.json'))['tests'][0]['candidate'])")
  for methods in "$candidate rkv" "full triattention snapkv"; do
    for end in 332 364 396 400; do
      for method in $methods; do
        trikv bench quality --task math --model qwen2.5-coder-1.5b --budgets 128 --samples 1 --math-batch 32 --temperature 0 \
          --max-new-tokens 1024 --problems "$(python -c "print(','.join(f'math500-{i}' for i in range(300, $end)))")" \
          --dtype bfloat16 --threads 2 --no-progress --out runs/quality/qwen2.5-coder-1.5b-heldout --methods $method
        keep_answers runs/quality/qwen2.5-coder-1.5b-heldout
      done
    done
  done
fi
if wants design; then
  trikv bench quality --task fidelity --model qwen2.5-coder-1.5b --traces design --budgets 128 \
    --methods full,triattention,triattention-recent,triattention-dedup,triattention-dedup-only,triattention-shared-layers,rkv,rkv-importance-only,snapkv-decode \
    --horizons 128,512,1024 --recall-stride 8 --dtype bfloat16 --threads 2 --no-progress --out runs/quality/qwen2.5-coder-1.5b-design
  keep runs/quality/qwen2.5-coder-1.5b-design
fi
if wants report; then
  # the kept copies stand in for run folders that are not on this machine
  folders=()
  for run in qwen2.5-coder-1.5b-traces qwen2.5-coder-0.5b-traces smollm2-135m-traces gemma3-270m-traces \
             qwen2.5-coder-1.5b-heldout2 qwen2.5-coder-1.5b-heldout qwen2.5-coder-1.5b-design smollm2-135m-prefill; do
    if [ -f runs/quality/$run/results.json ]; then folders+=(runs/quality/$run); elif [ -f docs/runs/$run/results.json ]; then folders+=(docs/runs/$run); fi
  done
  trikv bench report "${folders[@]}" --preregistration docs/preregistration.json --earlier docs/results-earlier.md \
    --replaces docs/results-2026-12-04.md --out docs/results.md
fi
if wants analysis; then
  runs=()
  for model in gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b smollm2-135m; do
    trikv analyze --model $model --out runs/analysis/$model --no-progress --threads 1
    runs+=(runs/analysis/$model/analysis.json)
  done
  # each run's figures and the plots the page shows are kept in docs/runs/analysis, and the page rendered from there
  python -m trikv.analysis.docs "${runs[@]}" --keep docs/runs/analysis --out docs/analysis.md
fi
wants earlier || exit 0

# ---- docs/results-earlier.md (before the equal prompt-protection rule; the runs below would now refuse to resume
# their folders and recompute under the current rule) ----------------------------------------------------------
# Times on 2 CPU cores, one thread per run: ~35 min for 8 methods of the 0.5B fidelity grid (~30 min more for the
# other 5, two threads, alone), ~45 min for each 1.5B one
# (two at once), ~10 min for the needle run, ~35 min for the quick preset under that load; the 1.5B needle,
# DFS and math runs use bfloat16 with two threads, alone on the machine (~4 min, ~15 min, ~85 min).
common=(--task fidelity --texts python-reference,math-solutions --text-tokens 4096 --horizons 128,512,1024,2048
        --recall-stride 8 --threads 1 --no-progress)
trikv bench quality "${common[@]}" --model qwen2.5-coder-0.5b --budgets 128,410 \
  --methods full,triattention,triattention-window,triattention-recent,triattention-dedup,snapkv,rkv,h2o,streaming,tova,knorm,tam-shared,pam-shared \
  --out runs/quality/qwen2.5-coder-0.5b-fidelity
trikv bench quality "${common[@]}" --model qwen2.5-coder-1.5b --budgets 410 \
  --methods full,triattention,triattention-window,triattention-dedup,snapkv,rkv,h2o,streaming,tova,knorm,tam-shared,pam-shared \
  --out runs/quality/qwen2.5-coder-1.5b-fidelity
trikv bench quality "${common[@]}" --model qwen2.5-coder-1.5b --budgets 128 \
  --methods full,triattention,triattention-window,triattention-dedup,snapkv,rkv,h2o,streaming,tova,knorm,tam-shared,pam-shared \
  --out runs/quality/qwen2.5-coder-1.5b-fidelity-b128
# budget 1024 = 25 % of each text (~14 min for the 0.5B, two threads alone)
trikv bench quality "${common[@]}" --model qwen2.5-coder-0.5b --budgets 1024 \
  --methods full,triattention,triattention-window,triattention-recent,triattention-dedup,snapkv,rkv,h2o,streaming,tova,knorm,tam-shared,pam-shared \
  --out runs/quality/qwen2.5-coder-0.5b-fidelity-b1024
# horizons out to 4K: one 8,192-token text (the Python language reference, topics in name order), B = 819 = 10 %
mkdir -p runs/texts
python - <<'PY'
import pydoc_data.topics as topics
parts = []
for name in sorted(topics.topics):
    parts.append(topics.topics[name].strip())
    if sum(len(part) for part in parts) >= 40000:
        break
open("runs/texts/python-reference-long.txt", "w", encoding="utf-8").write("\n\n".join(parts))
PY
trikv bench quality --task fidelity --text-file runs/texts/python-reference-long.txt --text-tokens 8192 \
  --horizons 128,512,1024,2048,4096 --recall-stride 8 --threads 2 --no-progress --model qwen2.5-coder-0.5b --budgets 819 \
  --methods full,triattention,triattention-window,triattention-dedup,snapkv,rkv,h2o,streaming \
  --out runs/quality/qwen2.5-coder-0.5b-fidelity-8k
# B = 1024 on the 1.5B, all twelve methods in one run (~35 min, two threads, alone)
trikv bench quality --task fidelity --texts python-reference,math-solutions --text-tokens 4096 --horizons 128,512,1024,2048 \
  --recall-stride 8 --threads 2 --no-progress --model qwen2.5-coder-1.5b --budgets 1024 \
  --methods full,triattention-window,h2o,tova,triattention,snapkv,rkv,triattention-dedup,streaming,knorm,tam-shared,pam-shared \
  --out runs/quality/qwen2.5-coder-1.5b-fidelity-b1024
trikv bench quality --task needle --model qwen2.5-coder-0.5b --needle-lengths 2048,4096 --needle-depths 0.25,0.75 \
  --methods full,triattention,triattention-window,snapkv,h2o,streaming --budgets 256 --threads 1 --no-progress \
  --out runs/quality/qwen2.5-coder-0.5b-needle
trikv bench quality --task needle --model qwen2.5-coder-0.5b --needle-lengths 8192 --needle-depths 0.25,0.75 \
  --methods full,triattention,triattention-window,snapkv,h2o --budgets 256 --threads 1 --no-progress \
  --out runs/quality/qwen2.5-coder-0.5b-needle-8k
trikv bench quality --task needle --model qwen2.5-coder-1.5b --needle-lengths 2048,4096 --needle-depths 0.25,0.75 \
  --methods full,triattention,triattention-dedup,snapkv,h2o,streaming --budgets 256 --dtype bfloat16 --threads 2 --no-progress \
  --out runs/quality/qwen2.5-coder-1.5b-needle
# teacher-forced DFS, chat prompt, 24 graphs, k up to 16 (~30 min, two threads alone)
trikv bench quality --task dfs --model qwen2.5-coder-1.5b --methods full,triattention,triattention-window,triattention-dedup,snapkv,rkv,h2o,streaming \
  --budgets 128,256 --dfs-graphs 24 --dfs-nodes 10,20 --dfs-ks 4,8,12,16 --dtype bfloat16 --threads 2 --no-progress \
  --out runs/quality/qwen2.5-coder-1.5b-dfs
# generative DFS: full attention answers none of the 24 queries on these graphs (~11 min), so no method is compared on them
trikv bench quality --task dfs --dfs-mode generative --model qwen2.5-coder-1.5b --methods full \
  --budgets 128 --dfs-graphs 6 --dfs-nodes 10,20 --dfs-ks 4,8,16,24 --dtype bfloat16 --threads 2 --no-progress \
  --out runs/quality/qwen2.5-coder-1.5b-dfs-generative
# ... nor on 6-9 node graphs at k = 2, 4, 6 (~3 min): the 1.5B cannot simulate the search itself
trikv bench quality --task dfs --dfs-mode generative --model qwen2.5-coder-1.5b --methods full \
  --budgets 64 --dfs-graphs 6 --dfs-nodes 6,9 --dfs-ks 2,4,6 --dtype bfloat16 --threads 2 --no-progress \
  --out runs/quality/qwen2.5-coder-1.5b-dfs-generative-small
# MATH-500 subset on the 1.5B: 32 held-out rows greedy in one batch, bfloat16 (~0.6 s per decode step of 32 rows on
# 2 cores with AMX; ~10-18 min per cell, one job at a time); at B=256 a 1,024-token answer overruns the budget ~4x
trikv bench quality --task math --model qwen2.5-coder-1.5b --budgets 256 \
  --methods full,triattention,triattention-window,triattention-recent,triattention-dedup,triattention-dedup-only,rkv,snapkv,streaming \
  --limit 32 --samples 1 --math-batch 32 --temperature 0 --max-new-tokens 1024 --dtype bfloat16 --threads 2 --no-progress \
  --out runs/quality/qwen2.5-coder-1.5b-math
# the same protocol on 100 problems for the methods the targets compare (batches of 32, 32, 32, 4; reuses the first 32
# problems' answers: copy the 32-problem folder first, then --limit 100 answers only problems 33-100, ~8-11 min a batch
# of 32, ~4 min the batch of 4). One process per cell: run as one grid, the fourth cell was once OOM-killed at 24 GB
# resident; alone a cell stays at ~9.5 GB (cells now hand freed memory back, and log their resident size, untested at 24 GB).
[ -d runs/quality/qwen2.5-coder-1.5b-math-100 ] || cp -r runs/quality/qwen2.5-coder-1.5b-math runs/quality/qwen2.5-coder-1.5b-math-100
math100=(--task math --model qwen2.5-coder-1.5b --budgets 256 --limit 100 --samples 1 --math-batch 32 --temperature 0
         --max-new-tokens 1024 --dtype bfloat16 --threads 2 --no-progress --out runs/quality/qwen2.5-coder-1.5b-math-100)
for method in triattention-dedup rkv triattention snapkv streaming; do trikv bench quality "${math100[@]}" --methods full,$method; done
trikv bench quality "${math100[@]}" --methods full,triattention-dedup,rkv,triattention,snapkv,streaming
# B = 1024 with up to 2,048 new tokens. Rounds are per row: a problem whose full-attention answer never brings its
# cache to B + 128 = 1,152 entries is answered by every method exactly as by full attention. Of the 100 problems above
# only the 11 that full attention ran to the 1,024-token cap get there, so only they need generating; math500-19 and
# math500-84, the two longest finished answers (1,135 and 1,102 entries, both wrong), ride along as a check that every
# method reproduces full attention's answer where nothing is evicted. The other 87 keep full attention's answers
# (batch of 13, ~16 min a cell). Full attention solves 1 of the 13, so no method can trail it or lead streaming by
# more than a point or so over the 100: the baselines' cells were left out.
trikv bench quality --task math --model qwen2.5-coder-1.5b --budgets 1024 --methods full,triattention,triattention-dedup \
  --problems math500-7,math500-15,math500-19,math500-25,math500-33,math500-36,math500-43,math500-60,math500-63,math500-64,math500-84,math500-96,math500-99 \
  --samples 1 --math-batch 13 --temperature 0 --max-new-tokens 2048 --dtype bfloat16 --threads 2 --no-progress \
  --out runs/quality/qwen2.5-coder-1.5b-math-long-b1024
# B = 256 with up to 2,048 new tokens on the same 100 problems: greedy answers that ended before the 1,024-token cap
# end there again, so the copied folder raises the cap in place and generates again only the answers that reached
# it (5-15 per method, one batch each, ~15-20 min a cell; one process per method as above). The new batch changes
# bf16 answers too: several regenerated answers end below 1,024 tokens. triattention-dedup's cell did not fit the
# session that ran the others.
[ -d runs/quality/qwen2.5-coder-1.5b-math-100-2048 ] || cp -r runs/quality/qwen2.5-coder-1.5b-math-100 runs/quality/qwen2.5-coder-1.5b-math-100-2048
math2048=(--task math --model qwen2.5-coder-1.5b --budgets 256 --limit 100 --samples 1 --math-batch 32 --temperature 0
          --max-new-tokens 2048 --dtype bfloat16 --threads 2 --no-progress --out runs/quality/qwen2.5-coder-1.5b-math-100-2048)
for method in triattention rkv snapkv triattention-dedup streaming; do trikv bench quality "${math2048[@]}" --methods full,$method; done
trikv bench quality "${math2048[@]}" --methods full,triattention,triattention-dedup,rkv,snapkv,streaming
# B = 512 on the same 100 problems, 1,024 new tokens (~30 min a method, two threads alone); full attention's answers
# are the same batches as at B = 256 and reproduce that run's full column. Two sessions ran it, one method at a time;
# the last invocation only collects the finished cells into results.json
m512=(--task math --model qwen2.5-coder-1.5b --budgets 512 --limit 100 --samples 1 --math-batch 32 --temperature 0
      --max-new-tokens 1024 --dtype bfloat16 --threads 2 --no-progress --out runs/quality/qwen2.5-coder-1.5b-math-100-b512)
for method in triattention rkv snapkv streaming triattention-dedup; do trikv bench quality "${m512[@]}" --methods full,$method; done
trikv bench quality "${m512[@]}" --methods full,triattention,triattention-dedup,rkv,snapkv,streaming
# B = 128 on the same 100 problems, 1,024 new tokens (~26 min a method, ~34 min for full attention, two threads alone);
# one invocation per method so each finished method is kept, the last only collects the cells into results.json
m128=(--task math --model qwen2.5-coder-1.5b --budgets 128 --limit 100 --samples 1 --math-batch 32 --temperature 0
      --max-new-tokens 1024 --dtype bfloat16 --threads 2 --no-progress --out runs/quality/qwen2.5-coder-1.5b-math-100-b128)
for method in triattention rkv snapkv streaming triattention-dedup; do trikv bench quality "${m128[@]}" --methods full,$method; done
trikv bench quality "${m128[@]}" --methods full,triattention,triattention-dedup,rkv,snapkv,streaming
# the 1.5B on the 8,192-token text (horizons out to 4K; ~45 min, two threads alone)
trikv bench quality --task fidelity --text-file runs/texts/python-reference-long.txt --text-tokens 8192 \
  --horizons 128,512,1024,2048,4096 --recall-stride 8 --threads 2 --no-progress --model qwen2.5-coder-1.5b --budgets 819 \
  --methods full,triattention,triattention-window,triattention-dedup,snapkv,rkv,h2o,streaming \
  --out runs/quality/qwen2.5-coder-1.5b-fidelity-8k
# the rest of the baselines on the same text, on both models (triattention again, as the anchor both runs share;
# ~22 min for the 1.5B, ~13 min for the 0.5B, two threads alone)
trikv bench quality --task fidelity --text-file runs/texts/python-reference-long.txt --text-tokens 8192 \
  --horizons 128,512,1024,2048,4096 --recall-stride 8 --threads 2 --no-progress --model qwen2.5-coder-1.5b --budgets 819 \
  --methods full,triattention,tova,knorm,tam-shared,pam-shared \
  --out runs/quality/qwen2.5-coder-1.5b-fidelity-8k-more
trikv bench quality --task fidelity --text-file runs/texts/python-reference-long.txt --text-tokens 8192 \
  --horizons 128,512,1024,2048,4096 --recall-stride 8 --threads 2 --no-progress --model qwen2.5-coder-0.5b --budgets 819 \
  --methods full,triattention,tova,knorm,tam-shared,pam-shared \
  --out runs/quality/qwen2.5-coder-0.5b-fidelity-8k-more
# the 1.5B's passkey at 8,192 tokens (bf16, two threads alone)
trikv bench quality --task needle --model qwen2.5-coder-1.5b --needle-lengths 8192 --needle-depths 0.1,0.25,0.5,0.75,0.9 \
  --methods full,triattention,triattention-window,triattention-dedup,snapkv,h2o,streaming --budgets 256 --dtype bfloat16 \
  --threads 2 --no-progress --out runs/quality/qwen2.5-coder-1.5b-needle-8k
trikv bench quality --methods full,triattention,triattention-window,snapkv,streaming --threads 2 --no-progress \
  --out runs/quality-quick
trikv bench report runs/quality-quick runs/quality/qwen2.5-coder-0.5b-fidelity runs/quality/qwen2.5-coder-0.5b-fidelity-b1024 \
  runs/quality/qwen2.5-coder-0.5b-fidelity-8k runs/quality/qwen2.5-coder-1.5b-fidelity \
  runs/quality/qwen2.5-coder-1.5b-fidelity-b128 runs/quality/qwen2.5-coder-1.5b-fidelity-b1024 runs/quality/qwen2.5-coder-0.5b-needle runs/quality/qwen2.5-coder-0.5b-needle-8k \
  runs/quality/qwen2.5-coder-1.5b-needle runs/quality/qwen2.5-coder-1.5b-dfs runs/quality/qwen2.5-coder-1.5b-dfs-generative \
  runs/quality/qwen2.5-coder-1.5b-dfs-generative-small \
  runs/quality/qwen2.5-coder-1.5b-math \
  runs/quality/qwen2.5-coder-1.5b-math-100 runs/quality/qwen2.5-coder-1.5b-math-long-b1024 \
  runs/quality/qwen2.5-coder-1.5b-math-100-2048 runs/quality/qwen2.5-coder-1.5b-fidelity-8k \
  runs/quality/qwen2.5-coder-1.5b-fidelity-8k-more runs/quality/qwen2.5-coder-0.5b-fidelity-8k-more \
  runs/quality/qwen2.5-coder-1.5b-needle-8k runs/quality/qwen2.5-coder-1.5b-math-100-b512 \
  runs/quality/qwen2.5-coder-1.5b-math-100-b128 --out docs/results-earlier.md

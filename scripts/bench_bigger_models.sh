#!/usr/bin/env bash
# The quality runs behind docs/results.md (resumable: rerun to continue), then the earlier runs behind
# docs/results-earlier.md (made before the equal prompt-protection rule; kept for their commands).
# Statistics: scripts/make_calibration_text.py --model M then `trikv calibrate` (shipped in src/trikv/data/stats).
# Times are for 2 CPU cores, one job at a time, two threads.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate

# ---- docs/results.md ------------------------------------------------------------------------------------------
# 1. each model's own reasoning traces (shipped in src/trikv/benchmarks/quality/data/traces; ~20-60 min each)
python -m trikv.benchmarks.quality.traces --model smollm2-135m --split evaluation --threads 2
python -m trikv.benchmarks.quality.traces --model qwen2.5-coder-1.5b --split design --dtype bfloat16 --threads 2
python -m trikv.benchmarks.quality.traces --model qwen2.5-coder-1.5b --split evaluation --dtype bfloat16 --threads 2
python -m trikv.benchmarks.quality.traces --model qwen2.5-coder-0.5b --split evaluation --dtype bfloat16 --threads 2
# Gemma-3-270M: its calibration text and statistics (global layers), then its traces (transformers engine: hybrid)
TRIKV_THREADS=2 python scripts/make_calibration_text.py --model gemma3-270m --count 16 --engine transformers \
  --out src/trikv/data/calibration/gemma3-270m-math500-traces.txt
trikv calibrate --model gemma3-270m --text src/trikv/data/calibration/gemma3-270m-math500-traces.txt \
  --out src/trikv/data/stats/gemma3-270m.safetensors
python -m trikv.benchmarks.quality.traces --model gemma3-270m --split evaluation --engine transformers --threads 2
# 2. the diagnosis on the 1.5B's design traces (why R-KV beats TriAttention on reasoning; chooses the candidate)
trikv bench quality --task fidelity --model qwen2.5-coder-1.5b --traces design --budgets 128 \
  --methods full,triattention,triattention-recent,triattention-dedup,triattention-dedup-only,triattention-shared-layers,rkv,rkv-importance-only,snapkv-decode \
  --horizons 128,512,1024 --recall-stride 8 --dtype bfloat16 --threads 2 --no-progress --out runs/quality/qwen2.5-coder-1.5b-design
# 3. the pre-registered held-out test (docs/preregistration.json): MATH-500 rows 300-399, B = 128, greedy, 1,024 tokens;
# in chunks of 32 problems (the batches of one 100-problem run), the candidate and R-KV first; every finished chunk is
# saved, so the run can be split over sittings (~10-12 min per method and chunk)
candidate=$(python -c "import json; print(json.load(open('docs/preregistration.json'))['tests'][0]['candidate'])")
for methods in "$candidate rkv" "full triattention snapkv"; do
  for end in 332 364 396 400; do
    for method in $methods; do
      trikv bench quality --task math --model qwen2.5-coder-1.5b --budgets 128 --samples 1 --math-batch 32 --temperature 0 \
        --max-new-tokens 1024 --problems "$(python -c "print(','.join(f'math500-{i}' for i in range(300, $end)))")" \
        --dtype bfloat16 --threads 2 --no-progress --out runs/quality/qwen2.5-coder-1.5b-heldout --methods $method
    done
  done
done
# 3b. the second pre-registered test (docs/preregistration.json, heldout-2): MATH-500 rows 137-199 and 433-499, B = 128
# (then 256), greedy, 1,024 tokens; TriAttention and R-KV first, in chunks of 32 problems (each finished chunk is saved)
heldout2=$(python -c "print(','.join(f'math500-{i}' for i in [*range(137, 200), *range(433, 500)]))")
for budget in 128 256; do
  for methods in "triattention rkv" "full triattention-dedup snapkv"; do
    for end in 32 64 96 128 130; do
      for method in $methods; do
        [ "$method" = full ] && [ "$budget" = 256 ] && continue  # full attention does not depend on the budget
        trikv bench quality --task math --model qwen2.5-coder-1.5b --budgets $budget --samples 1 --math-batch 32 --temperature 0 \
          --max-new-tokens 1024 --problems "$(echo "$heldout2" | cut -d, -f1-$end)" \
          --dtype bfloat16 --threads 2 --no-progress --out runs/quality/qwen2.5-coder-1.5b-heldout2 --methods $method
      done
    done
  done
done
# 4. fidelity and recall on each model's evaluation traces, the whole field (~1-2 h each)
field=full,triattention,triattention-shared-layers,triattention-window,triattention-recent,triattention-dedup,rkv,snapkv,snapkv-decode,h2o,streaming,tova,tam-shared
traces=(--task fidelity --traces evaluation --horizons 128,512,1024 --recall-stride 8 --threads 2 --no-progress --methods $field)
trikv bench quality "${traces[@]}" --model smollm2-135m --budgets 128,256 --out runs/quality/smollm2-135m-traces
trikv bench quality "${traces[@]}" --model qwen2.5-coder-0.5b --budgets 128,256 --dtype bfloat16 --out runs/quality/qwen2.5-coder-0.5b-traces
trikv bench quality "${traces[@]}" --model qwen2.5-coder-1.5b --budgets 128 --dtype bfloat16 --out runs/quality/qwen2.5-coder-1.5b-traces
# Gemma-3-270M: ~4 min per method and budget (its 262K-token vocabulary makes each KL costly); the whole field at
# B = 128 (the page's run); B = 256 was run for six methods only (full, triattention, rkv, snapkv, streaming, h2o)
trikv bench quality "${traces[@]}" --model gemma3-270m --budgets 128 --out runs/quality/gemma3-270m-traces
# the page (the evaluation traces first, then the held-out test and the diagnosis)
trikv bench report runs/quality/qwen2.5-coder-1.5b-traces runs/quality/qwen2.5-coder-0.5b-traces runs/quality/smollm2-135m-traces \
  runs/quality/gemma3-270m-traces runs/quality/qwen2.5-coder-1.5b-heldout runs/quality/qwen2.5-coder-1.5b-design \
  --preregistration docs/preregistration.json --earlier docs/results-earlier.md --out docs/results.md
# Q/K concentration of every bundled model (global vs sliding layers for Gemma-3; ~3 min in all)
for model in smollm2-135m gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
  trikv analyze --model $model --out runs/analysis/$model --no-progress
done
python -m trikv.analysis.docs runs/analysis/*/analysis.json --out docs/analysis.md

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

#!/usr/bin/env bash
# The main job: set up, then generate 1,500 tokens with full attention and with TriAttention (B=256),
# both through the lean engine (`--engine transformers` uses the transformers forward).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec trikv demo "$@"

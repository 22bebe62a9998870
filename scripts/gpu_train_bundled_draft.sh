#!/usr/bin/env bash
# EAGLE-3 draft for the bundled SmolLM2-135M-Instruct on one H200 (bf16), in two device calls.
#
#   bash scripts/gpu_train_bundled_draft.sh train   # call 1: regenerate data + train, ~8 min
#   bash scripts/gpu_train_bundled_draft.sh eval    # call 2: accept length K=1..5, < 5 min
#
# Run from the repository root with PYTHONPATH=/tmp/site:./python (the carried wheels and this
# tree) and $OUT set (the folder whose files come back). Target: the bundled model, or
# MODEL=/path/to/model.gguf|hf_dir. Everything is plain env knobs (defaults below).
#
# train: (1) scripts/prepare_draft_data.py --regenerate-into: the target answers the ShareGPT
# prompts of benchmark/data/sharegpt_train_prompts_all_turns.jsonl.gz in order, greedily, in batched chunks
# sized from the measured throughput, and stops before GEN_BUDGET_S (counted from its start,
# engine start-up and GGUF conversion included). (2) python -m sglang.train_eagle3 reuses those
# sequences (train_state/sequences.json) and trains for
#   steps = min(MAX_STEPS, max(MIN_STEPS, min(ceil(EPOCHS * train sequences / BATCH_SIZE),
#                                             (TOTAL_BUDGET_S - elapsed - reserve) / STEP_S_EST)))
# where reserve covers target load, state capture (Triton attention, states kept on the GPU) and
# the final evaluation. The checkpoint is
# trained in WORK (default /tmp/smollm2_eagle3, kept for call 2 while the machine stays warm).
# Back in $OUT (at most 8 files of 16 MiB): smollm2_eagle3/config.json, the bf16
# model.safetensors (~19 MB) split in 15 MiB parts (join: cat model.safetensors.part* >
# model.safetensors; sha256 in model.safetensors.sha256), train.log, metrics.jsonl and
# run_summary.json (phase timings, regeneration stats, simulated accept lengths). The
# regenerated data stays in WORK/train_state/sequences.json (tens of MB: over what comes back)
# while the machine is warm; a later call can train longer on it without regenerating.
#
# Knobs when the time does not fit: GEN_BUDGET_S (data volume; decode speed of the attention
# backend decides how many prompts that buys), MAX_NEW_TOKENS, MAX_STEPS / EPOCHS, BATCH_SIZE,
# LR; for eval: EVAL_PROMPTS, EVAL_BUDGET_S, EVAL_K.
set -euo pipefail
MODE=${1:-train}
: "${OUT:?set OUT to the output folder}"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-10}
PY=${PY:-python3}
WORK=${WORK:-/tmp/smollm2_eagle3}
PROMPTS=${PROMPTS:-benchmark/data/sharegpt_train_prompts_all_turns.jsonl.gz}
NUM_PROMPTS=${NUM_PROMPTS:-28000}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
GEN_BUDGET_S=${GEN_BUDGET_S:-200}
TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-540}
FIRST_CHUNK=${FIRST_CHUNK:-64}
MAX_CHUNK=${MAX_CHUNK:-1024}
BATCH_SIZE=${BATCH_SIZE:-32}
EPOCHS=${EPOCHS:-4}
MIN_STEPS=${MIN_STEPS:-50}
MAX_STEPS=${MAX_STEPS:-3000}
STEP_S_EST=${STEP_S_EST:-0.08}
LR=${LR:-1e-3}
TTT_STEPS=${TTT_STEPS:-3}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
DEVICE=${DEVICE:-cuda}  # cpu only for a smoke test of this script
EVAL_PROMPTS=${EVAL_PROMPTS:-40}
EVAL_BUDGET_S=${EVAL_BUDGET_S:-270}
EVAL_K=${EVAL_K:-3 1 2 4 5}
DRAFT=${DRAFT:-$WORK}
TAG=${TAG:-h200}
MODEL_ARG=()
TARGET_ARG=()
if [ -n "${MODEL:-}" ]; then
  MODEL_ARG=(--model-path "$MODEL")
  TARGET_ARG=(--target-model-path "$MODEL")
fi
mkdir -p "$OUT"

if [ "$MODE" = eval ]; then
  # shellcheck disable=SC2086
  "$PY" benchmark/eagle3_accept_length.py --draft-path "$DRAFT" "${MODEL_ARG[@]}" \
    --k $EVAL_K --datasets mtbench humaneval --num-prompts "$EVAL_PROMPTS" \
    --max-new-tokens "$MAX_NEW_TOKENS" --time-budget-s "$EVAL_BUDGET_S" \
    --output "$OUT/eagle3_accept_length_$TAG.json" 2>&1 | tee "$OUT/eval.log"
  exit "${PIPESTATUS[0]}"
fi
[ "$MODE" = train ] || { echo "usage: $0 [train|eval]" >&2; exit 2; }

LOG=$OUT/train.log
T0=$(date +%s)
{
  echo "== $(date -u +%FT%TZ) train: WORK=$WORK NUM_PROMPTS=$NUM_PROMPTS MAX_NEW_TOKENS=$MAX_NEW_TOKENS" \
    "GEN_BUDGET_S=$GEN_BUDGET_S TOTAL_BUDGET_S=$TOTAL_BUDGET_S BATCH_SIZE=$BATCH_SIZE EPOCHS=$EPOCHS" \
    "MAX_STEPS=$MAX_STEPS LR=$LR TTT_STEPS=$TTT_STEPS DRAFT_VOCAB=$DRAFT_VOCAB"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
  git log --oneline -1 || true
} 2>&1 | tee "$LOG"
rm -rf "$WORK"

# (1) self-distilled data, time-boxed
"$PY" scripts/prepare_draft_data.py --regenerate-into "$WORK" "${MODEL_ARG[@]}" \
  --prompts-path "$PROMPTS" --max-prompts "$NUM_PROMPTS" --max-new-tokens "$MAX_NEW_TOKENS" \
  --time-budget-s "$GEN_BUDGET_S" --first-chunk "$FIRST_CHUNK" --max-chunk "$MAX_CHUNK" \
  2>&1 | tee -a "$LOG"
T1=$(date +%s)

# (2) steps from the data and the time left
read -r N_SEQ N_TOK STEPS < <("$PY" - "$WORK" "$((T1 - T0))" <<EOF
import json, math, sys
st = json.load(open(sys.argv[1] + "/train_state/regen_stats.json"))
n, tok = st["sequences"], st["total_tokens"]
n_train = n - int(n * 0.05)  # TrainConfig.eval_fraction
by_epochs = math.ceil($EPOCHS * n_train / $BATCH_SIZE)
reserve = 60 + tok / 200000  # target load + state capture + final eval and save
by_time = int(($TOTAL_BUDGET_S - int(sys.argv[2]) - reserve) / $STEP_S_EST)
print(n, tok, min($MAX_STEPS, max($MIN_STEPS, min(by_epochs, by_time))))
EOF
)
echo "== regenerated $N_SEQ sequences ($N_TOK tokens) in $((T1 - T0)) s; training $STEPS steps" \
  | tee -a "$LOG"

"$PY" -m sglang.train_eagle3 --output-dir "$WORK" "${TARGET_ARG[@]}" \
  --prompts-path "$PROMPTS" --num-prompts "$NUM_PROMPTS" --max-new-tokens "$MAX_NEW_TOKENS" \
  --draft-vocab-size "$DRAFT_VOCAB" --steps "$STEPS" --batch-size "$BATCH_SIZE" --lr "$LR" \
  --ttt-steps "$TTT_STEPS" --seed 0 --device "$DEVICE" --log-every 25 --save-every 1000000 \
  2>&1 | tee -a "$LOG"
T2=$(date +%s)

# (3) what comes back
mkdir -p "$OUT/smollm2_eagle3"
cp "$WORK/config.json" "$OUT/smollm2_eagle3/"
split -b 15M -d -a 1 "$WORK/model.safetensors" "$OUT/smollm2_eagle3/model.safetensors.part"
(cd "$WORK" && sha256sum model.safetensors) > "$OUT/smollm2_eagle3/model.safetensors.sha256"
cp "$WORK/train_state/metrics.jsonl" "$OUT/"
"$PY" - "$WORK" "$OUT/run_summary.json" "$T0" "$T1" "$T2" "$STEPS" <<'EOF'
import json, os, sys
work, dst, t0, t1, t2, steps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
state = os.path.join(work, "train_state")
summary = {
    "phase_s": {"regenerate": t1 - t0, "train_incl_capture_and_eval": t2 - t1},
    "steps": steps,
    "checkpoint_bytes": os.path.getsize(os.path.join(work, "model.safetensors")),
    "regen": json.load(open(os.path.join(state, "regen_stats.json"))),
    "train": json.load(open(os.path.join(state, "summary.json"))),
}
json.dump(summary, open(dst, "w"), indent=1)
print(json.dumps({k: summary[k] for k in ("phase_s", "steps", "checkpoint_bytes")}))
print("simulated accept length (held-out):", summary["train"].get("eval", {}).get("accept_length_at"))
EOF
echo "== done in $(( $(date +%s) - T0 )) s; checkpoint $WORK ($(du -b "$WORK/model.safetensors" | cut -f1) bytes)" \
  | tee -a "$LOG"
ls -la "$OUT" "$OUT/smollm2_eagle3" | tee -a "$LOG"

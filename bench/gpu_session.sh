#!/usr/bin/env bash
# The plugin's GPU checks, most needed first, each under its own time limit; logs and JSON under $OUT.
#
# Run from the repository root on a GPU machine whose python imports sglang 0.5.23 with CUDA (docs/gpu.md:
# the test bed's environment). A device call may run for 10 minutes, so pick the steps per call:
#
#   STEPS=tests,host bash bench/gpu_session.sh           # GPU tests, hooks' host time (2026-11-26 H100: 110 + 10 s)
#   STEPS=random bash bench/gpu_session.sh               # round times, no model files (two engines: ~5 min)
#   STEPS=paired bash bench/gpu_session.sh               # eagle2 vs native in ABBA blocks (one engine, no model files)
#   STEPS=profile bash bench/gpu_session.sh               # the demo target: auto vs torch vs native vs plain
#   STEPS=flashinfer,bf16,eagle3 bash bench/gpu_session.sh
#   STEPS=fi,firandom bash bench/gpu_session.sh           # FlashInfer carried (bench/gpu_flashinfer.sh), no model files
#
# Steps: tests (pytest -m gpu, one file per process: bench/gpu_tests.sh); host (the hooks' host time per round,
# bench/round_host_cost.py, on this GPU's host with real CUDA dispatch, the selection's device work stubbed); random
# (the profile below on a random-weight target of the demo target's shape: round times and outputs == plain, no
# accept lengths); paired (on the same target, native against eagle2, eagle2-small, the mix and itself in ABBA
# blocks, bench/round_pairs.py: the gap per decode round with the run's drift cancelled); profile (float32, Triton attention, selection auto vs torch, beside native and plain, outputs
# compared with plain); fi (installs the carried FlashInfer: bench/gpu_flashinfer.sh); firandom (SGLang's FlashInfer
# backend, bf16, on the random target: our custom-mask verify's outputs against plain and its round times);
# flashinfer (padded, ragged and tuned verify per batch size on the demo target); bf16; eagle3 (the shipped EAGLE-3
# head). Each profile runs concurrency 1, 16 and 64 over 64 prompts (held-out ones on the demo target).
set -uo pipefail
OUT=${OUT:-bench/measured/gpu-run}
STEPS=${STEPS:-tests,host,random,paired,fi,firandom,profile,flashinfer,bf16,eagle3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/card.txt" 2>&1 || true
# PROFILE_BS: the concurrencies every profile step serves (fewer when a session's device time runs short)
PROFILE=(python bench/plugin_round_profile.py --device cuda --bs "${PROFILE_BS:-1,16,64}" --prompts 64 --no-ops)

step() {  # step NAME SECONDS COMMAND...: run it when STEPS names it; its output on stdout and in $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    case ",$STEPS," in *",$name,"*) ;; *) return 0 ;; esac
    local start=$SECONDS
    # streamed, not only logged: after a hang the device machine may not hand $OUT back (seen on an H100), and
    # the call's stdout is then all that returns; -k: a step that ignores the TERM is killed 20 s later
    timeout -k 20 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "$name: rc ${PIPESTATUS[0]} in $((SECONDS - start)) s" | tee -a "$OUT/steps.txt"
}

step tests 330 env GPU_TESTS_S=300 bash bench/gpu_tests.sh  # one file per process, each under its own limit
step host 90 python bench/round_host_cost.py --device cuda --json "$OUT/round_host_cost.json"
# before the demo target's files are there: the round times on a random target of its shape (no tokenizer)
# (16 new tokens: on an H100 the two engines' starts and the per-size warm-ups took most of 5 minutes)
step random 420 "${PROFILE[@]}" --target random --plain --select auto --max-new-tokens 16 --out "$OUT/random.json"
step paired 420 "${PROFILE[@]}" --target random --select auto --max-new-tokens 16 --paired 8 \
    --sets native,eagle2,eagle2-small,mix --out "$OUT/paired.json"
# FlashInfer (carried: bench/gpu_flashinfer.sh) sits in a site of its own, on the path of its steps only
WITH_FI=(env "PYTHONPATH=${FI_SITE:-/root/site-flashinfer}${PYTHONPATH:+:$PYTHONPATH}")
step fi 60 bash bench/gpu_flashinfer.sh install  # joins, checks and unpacks the staged pieces: ~15 s
step firandom 420 "${WITH_FI[@]}" "${PROFILE[@]}" --target random --attention flashinfer --dtype bfloat16 --plain \
    --select auto --max-new-tokens 16 --out "$OUT/flashinfer_random.json"
step profile 540 "${PROFILE[@]}" --plain --select auto,torch --out "$OUT/profile.json"
# FlashInfer has no float32 kernels: bf16, beside the bf16 step's Triton figures
step flashinfer 540 "${WITH_FI[@]}" "${PROFILE[@]}" --attention flashinfer --dtype bfloat16 --select auto --ragged 0,1,tuned \
    --out "$OUT/flashinfer_ragged.json"
step bf16 240 "${PROFILE[@]}" --dtype bfloat16 --plain --select auto --out "$OUT/bf16.json"
step eagle3 240 "${PROFILE[@]}" --draft demo-eagle3 --select auto --out "$OUT/eagle3.json"

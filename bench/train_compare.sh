#!/usr/bin/env bash
# Train the demo target's draft head with each loss on the same self-distillation data for the same
# steps, then measure held-out tau with EAGLE-2 (N=60) at T=0 and T=1. CPU-sized defaults.
# Usage: bash bench/train_compare.sh [steps] [losses...]
# FT_STEPS=100 adds the SALF & TALF paper's protocol: continue the KL head with TALF and with KL (lr 3e-4).
set -euo pipefail
STEPS=${1:-150}; shift || true
LOSSES=${*:-kl lk-alpha lk-lambda talf}
DATA=${DATA:-data/distill}
TREES=${TREES:-data/talf-trees}
OUT=${OUT:-checkpoints/compare}
THREADS=${THREADS:-2}
[ -f "$DATA/manifest.json" ] || treespec train data --out "$DATA" --max-new-tokens 96 --batch-size 16 --threads "$THREADS"
if [[ " $LOSSES " == *" talf "* ]]; then  # TALF: the target's trees (k=4, depth 3), once; resumable
  treespec train trees --data "$DATA" --topk 4 --depth 3 --threads "$THREADS" --out "$TREES"
fi
for loss in $LOSSES; do
  treespec train draft --data "$DATA" --loss "$loss" --trees "$TREES" --steps "$STEPS" --lr 1e-3 --ttt-steps 2 \
    --eval-every 50 --threads "$THREADS" --out "$OUT/$loss"
done
RUNS=$LOSSES
if [ -n "${FT_STEPS:-}" ]; then
  for loss in talf kl; do
    treespec train draft --data "$DATA" --loss "$loss" --trees "$TREES" --init "$OUT/kl" --steps "$FT_STEPS" \
      --lr 3e-4 --ttt-steps 2 --eval-every 50 --threads "$THREADS" --out "$OUT/ft-$loss"
  done
  RUNS="$RUNS ft-talf ft-kl"
fi
for loss in $RUNS; do
  for T in 0 1; do
    treespec bench --draft "$OUT/$loss" --every 10 --policies "" \
      --policy-json '{"policy": "eagle2", "budget": 60, "topk": 10, "depth": 6}' \
      --max-new-tokens 48 --batch-size 8 --temperature "$T" --threads "$THREADS" --out "$OUT/$loss/bench-T$T"
  done
done

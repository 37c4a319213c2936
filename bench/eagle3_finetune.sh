#!/usr/bin/env bash
# Issue protocol for the EAGLE-3 head (TALF paper §4: a KL-trained head, then more steps of TALF or of
# the baseline loss): from ONE KL-trained EAGLE-3 checkpoint (default: the shipped demo-eagle3 head),
# fine-tune with KL (the control), LK-alpha and TALF for the same steps, batch and lr on the same data,
# then compare held-out alpha and tau (bench/heads_compare.py) for the start and the three results.
# CPU-sized defaults: the HumanEval + MT-bench sequences of bench/data/smollm2-distill-tokens.
# Usage: bash bench/eagle3_finetune.sh [steps] [batch]      (resumable: every stage skips finished work)
set -euo pipefail
STEPS=${1:-100}; BATCH=${2:-4}
INIT=${INIT:-treespec_sglang/assets/smollm2-135m-eagle3}
WORK=${WORK:-data/e3ft}; OUT=${OUT:-checkpoints/e3ft}
LR=${LR:-2e-4}; TTT=${TTT:-6}
if [ ! -f "$WORK/tokens/manifest.json" ]; then  # the first 244 stored sequences: HumanEval 164 + MT-bench 80
  python bench/subset_distill.py --src bench/data/smollm2-distill-tokens --sets humaneval,mtbench --out "$WORK/tokens"
fi
treespec train states --data "$WORK/tokens" --out "$WORK/states" --batch-size 8
treespec train trees --data "$WORK/states" --out "$WORK/trees" --topk 4 --depth 3
for loss in kl lk-alpha talf; do
  treespec train draft --init "$INIT" --loss "$loss" --data "$WORK/states" --trees "$WORK/trees" --steps "$STEPS" \
    --batch-size "$BATCH" --lr "$LR" --ttt-steps "$TTT" --eval-every "$STEPS" --eval-prompts 0 --resume \
    --out "$OUT/$loss"
done
python bench/heads_compare.py --data "$WORK/states" --drafts "$INIT,$OUT/kl,$OUT/lk-alpha,$OUT/talf" \
  --policies "${POLICIES:-eagle2,talon}" --budgets 8,16 --out "${REPORT:-$OUT/heads_compare.json}"

#!/usr/bin/env bash
# One GPU time slice of the `paper` experiment and the full-size benchmarks, as one prepared script.
#
#   BUDGET=540 OUT=/path/for/results bash scripts/gpu_slice.sh
#
# * Continues the paper preset (or $PRESET) from the units already committed under results/paper/units
#   (finished encoding x seed pairs are skipped), stops cleanly (SIGINT) before BUDGET seconds,
#   and copies every finished unit, the tidy table and the report back to results/paper/ and $OUT.
# * Runs the CUDA-only tests (attention fast paths, generation with a cache), then the attention,
#   training-throughput, long-evaluation and generation benchmarks at full size (a few minutes),
#   unless SKIP_BENCH=1 or their JSON already exists.
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-540}
PRESET=${PRESET:-paper}          # PRESET=ci SKIP_BENCH=1 rehearses the whole script on a CPU in a minute
RESULTS=results/$PRESET
RUN=runs/$PRESET
OUT=${OUT:-$RESULTS-out}
PY=${PY:-python}
start=$(date +%s)
mkdir -p "$OUT" results/benchmarks "$RESULTS/units" "$RUN/units"
left() { echo $(( BUDGET - ($(date +%s) - start) )); }

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  # the CUDA-only tests (FlexAttention at 4,096 tokens, bf16 fast paths against the reference)
  timeout 300 $PY -m pytest -q -o addopts="" tests/test_attention.py tests/test_generate.py -k "cuda" 2>&1 | tail -5 | tee "$OUT/cuda-tests.txt"
fi

if [ "${SKIP_BENCH:-0}" != 1 ] && [ ! -f results/benchmarks/gpu-attention.json ]; then
  timeout $(( $(left) / 4 )) $PY benchmarks/attention.py --json results/benchmarks/gpu-attention.json | tee "$OUT/gpu-attention.txt"
  timeout $(( $(left) / 4 )) $PY benchmarks/train_throughput.py --json results/benchmarks/gpu-train.json | tee "$OUT/gpu-train.txt"
  timeout $(( $(left) / 6 )) $PY benchmarks/long_eval.py --n-layer 12 --n-head 8 --d-model 512 --lengths 2048,8192,32768 \
    --json results/benchmarks/gpu-long-eval.json | tee "$OUT/gpu-long-eval.txt"
  timeout $(( $(left) / 8 )) $PY benchmarks/generate.py --device cuda --n-layer 12 --n-head 8 --d-model 512 \
    --json results/benchmarks/gpu-generate.json | tee "$OUT/gpu-generate.txt"
  cp results/benchmarks/gpu-*.json "$OUT"/ 2>/dev/null
fi

cp -n "$RESULTS"/units/*.json "$RUN"/units/ 2>/dev/null
[ -f "$RESULTS/config.json" ] && cp -n "$RESULTS/config.json" "$RUN"/
timeout --signal=INT --kill-after=30 $(( $(left) - 45 )) $PY -m posenc_lab run --preset "$PRESET" --out "$RUN" --no-progress --no-report
cp "$RUN"/units/*.json "$RESULTS"/units/ 2>/dev/null
cp "$RUN"/config.json "$RUN"/results.csv "$RUN"/results.json "$RESULTS"/ 2>/dev/null
$PY -m posenc_lab report "$RESULTS" --no-figures | tee "$OUT/$PRESET-report.txt"
tar czf "$OUT/$PRESET-results.tgz" -C results "$PRESET"
echo "units finished: $(ls "$RESULTS"/units | wc -l); seconds used: $(( $(date +%s) - start ))"

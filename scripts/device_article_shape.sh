#!/usr/bin/env bash
# The article's model shape (preset article-shape: 12 layers, 8 heads, width 512, trained at 512) in one call of a
# lent GPU machine, packed into $OUT as its units finish.
#
#   bash scripts/device_article_shape.sh          # on the GPU machine (carry .corpus; see book/running.md)
#   PRESET=ci RUN_ARGS="--encodings nope,alibi,t5 --seeds 0 --steps 6" JOBS=2 PACK_EVERY=5 \
#     bash scripts/device_article_shape.sh        # the same path at a tiny size on the CPU (tests/test_device_scripts.py)
#
# 1. A probe of about 30 s (scripts/article_shape.py probe) measures the card and stops the call, saying why, when
#    even the compiled path could not train the preset's bytes before DEADLINE.
# 2. The run: every unit in its own process (--jobs), seed-major, so seed 0 of every encoding finishes first.
#    The units compile on CUDA (inductor's cache on disk is shared by the processes).
# 3. Every PACK_EVERY seconds, and once more at the end, the finished units, the config and the logs are packed into
#    $OUT/units.tar.gz; at DEADLINE the run is stopped and what finished is kept.
# 4. The precision check: ALiBi's and T5's seed 0 at the longest length, as run (bf16) and in float32.
# $OUT then holds at most six files: units.tar.gz, probe.json, precision.json, run.log, gpu.txt, env.txt. The float16
# weights of seed 0 (about 76 MB per encoding at this shape) do not fit the 16 MiB a returned file may have.
set -u
OUT=${OUT:-/tmp/device-out}
PRESET=${PRESET:-article-shape}
RUN_ARGS=${RUN_ARGS:-}
JOBS=${JOBS:-5}
DEADLINE=${DEADLINE:-500}
PACK_EVERY=${PACK_EVERY:-30}
PY=${PY:-python3}
RUN=${RUN:-runs/$PRESET}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export POSENC_GIT_COMMIT=${POSENC_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT" runs
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

# the evaluation text of the headline: Python 3.11.7's standard library, carried as a tarball (.corpus/stdlib311)
if [ -n "${CORPUS:-}" ]; then
  corpus=$CORPUS
else
  stdlib=/tmp/posenc-stdlib311
  if [ ! -d "$stdlib" ]; then
    mkdir -p "$stdlib" && tar xzf .corpus/stdlib311/lib.tar.gz -C "$stdlib" || { echo "no .corpus/stdlib311/lib.tar.gz"; exit 2; }
  fi
  corpus=stdlib:$stdlib@3.11.7
fi
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu only')" | tee "$OUT/env.txt" || exit 2

# shellcheck disable=SC2086
$PY scripts/article_shape.py probe --preset "$PRESET" $RUN_ARGS --deadline "$DEADLINE" --json "$OUT/probe.json"
status=$?
if [ $status != 0 ]; then
  echo "$(elapsed) s: the probe stopped the call (status $status)"
  exit $status
fi
echo "$(elapsed) s: probe done"

# shellcheck disable=SC2086
$PY -m posenc_lab run --preset "$PRESET" $RUN_ARGS --jobs "$JOBS" --corpus "$corpus" --no-progress --no-report \
    --out "$RUN" > "$OUT/run.log" 2>&1 &
pid=$!

pack() {
  tar czf "$OUT/units.tar.gz.tmp" "$RUN/config.json" "$RUN/units" "$RUN/logs" 2>/dev/null \
    && mv "$OUT/units.tar.gz.tmp" "$OUT/units.tar.gz"
  echo "$(elapsed) s: $(ls "$RUN"/units/*.json 2>/dev/null | wc -l) units finished"
}

while kill -0 "$pid" 2>/dev/null; do
  if [ "$(elapsed)" -ge "$DEADLINE" ]; then
    echo "deadline of $DEADLINE s reached: stopping the run"
    kill -INT "$pid" 2>/dev/null
    sleep 5
    pkill -KILL -P "$pid" 2>/dev/null
    kill -KILL "$pid" 2>/dev/null
    break
  fi
  sleep "$PACK_EVERY"
  pack
done
wait "$pid" 2>/dev/null
pack
tail -n 5 "$OUT/run.log"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>/dev/null || echo "no nvidia-smi" > "$OUT/gpu.txt"
$PY scripts/article_shape.py precision "$RUN" --corpus "$corpus" --json "$OUT/precision.json"
echo "$(elapsed) s: done"

#!/usr/bin/env bash
# More seeds of the headline runs in one call on a lent GPU machine, packed into $OUT as they finish.
#
#   bash scripts/device_seeds.sh                    # on the GPU machine: seeds 3-9 of article-long-b4 and prose-long-b4
#   SEEDS=3 PRESETS=ci DEADLINE=120 bash scripts/device_seeds.sh   # the same path at a tiny size (the CPU smoke test)
#
# The GPU machine's Python is not 3.11.7, so the Python corpus travels as a tarball of 3.11.7's standard library
# (.corpus/stdlib311/lib.tar.gz, made here from the running 3.11.7) and the prose corpus as `make corpus-prose` left it;
# name `.corpus` in the call's carry. Both runs go side by side, seed-major, each unit in its own process (--jobs).
# Every PACK_EVERY seconds, and once more at the end, the finished units, configs and logs are packed into
# $OUT/units.tar.gz, so a call cut short still brings back every finished unit. The units committed in
# runs-in-progress/<preset>-seeds are copied in first and not trained again. At DEADLINE seconds the runs are
# stopped; their unfinished units are lost with the machine, the finished ones are not.
set -u
OUT=${OUT:-/tmp/device-out}
SEEDS=${SEEDS:-3,4,5,6,7,8,9}
PRESETS=${PRESETS:-article-long-b4 prose-long-b4}
JOBS=${JOBS:-8}
DEADLINE=${DEADLINE:-520}
PACK_EVERY=${PACK_EVERY:-30}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export POSENC_GIT_COMMIT=${POSENC_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT" runs
start=$(date +%s)

stdlib=/tmp/posenc-stdlib311
if [ ! -d "$stdlib" ]; then
  mkdir -p "$stdlib" && tar xzf .corpus/stdlib311/lib.tar.gz -C "$stdlib" || { echo "no .corpus/stdlib311/lib.tar.gz"; exit 2; }
fi
$PY - <<'EOF' || exit 2
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu only", flush=True)
EOF

pids=()
for preset in $PRESETS; do
  # the units an earlier call (or session) finished and committed: carried on, not trained again
  if [ -d "runs-in-progress/$preset-seeds" ] && [ ! -d "runs/$preset-seeds" ]; then
    cp -r "runs-in-progress/$preset-seeds" "runs/$preset-seeds"
  fi
  case $preset in
    prose*) corpus=prose:.corpus/prose ;;
    *) corpus=stdlib:$stdlib@3.11.7 ;;
  esac
  $PY -m posenc_lab run --preset "$preset" --seeds "$SEEDS" --jobs "$JOBS" --corpus "$corpus" \
      --no-report --no-progress --out "runs/$preset-seeds" > "runs/$preset-seeds.log" 2>&1 &
  pids+=($!)
done

pack() {
  tar czf "$OUT/units.tar.gz.tmp" runs/*-seeds/config.json runs/*-seeds/units runs/*-seeds/logs runs/*-seeds.log \
      2>/dev/null && mv "$OUT/units.tar.gz.tmp" "$OUT/units.tar.gz"
  echo "$(( $(date +%s) - start )) s: $(ls runs/*-seeds/units/*.json 2>/dev/null | wc -l) units finished"
}

while :; do
  alive=0
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
  [ $alive = 0 ] && break
  if [ $(( $(date +%s) - start )) -ge "$DEADLINE" ]; then
    echo "deadline of $DEADLINE s reached: stopping the runs"
    for pid in "${pids[@]}"; do kill -INT "$pid" 2>/dev/null; done
    sleep 5
    for pid in "${pids[@]}"; do pkill -KILL -P "$pid" 2>/dev/null; kill -KILL "$pid" 2>/dev/null; done
    break
  fi
  sleep "$PACK_EVERY"
  pack
done
wait 2>/dev/null
pack
nvidia-smi --query-gpu=name,memory.used --format=csv 2>/dev/null
tail -n 3 runs/*-seeds.log

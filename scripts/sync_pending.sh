#!/usr/bin/env bash
# Copy the finished units of a long run into a tracked folder, so that a replaced machine loses nothing.
#   scripts/sync_pending.sh RUN_DIR PENDING_DIR      e.g.  scripts/sync_pending.sh runs/article-cpu pending/article-cpu
# To continue the run on a fresh machine:
#   mkdir -p runs && cp -r pending/article-cpu runs/ && python -m posenc_lab run --preset article-cpu --out runs/article-cpu
# (the runner skips every unit whose units/<name>.json exists and refuses a folder made with other options).
# Seed-0 weights are kept (models/*-s0.pt, float16) for the chapters' diagnostics; the other seeds' weights stay in
# RUN_DIR only (a replaced machine loses them; the results do not need them), unless SEEDS names them: SEEDS="0 1 2"
# keeps every seed's (as article-long does, so that the context experiment can later run on all its seeds).
set -euo pipefail
run=${1:?run folder}; pending=${2:?pending folder}
mkdir -p "$pending/units" "$pending/models"
cp "$run/config.json" "$pending/"
cp "$run"/units/*.json "$pending/units/" 2>/dev/null || true
python=${PYTHON:-.venv/bin/python}
for seed in ${SEEDS:-0}; do   # weights as float16, as results/<run>/models holds them
  for model in "$run"/models/*-s"$seed".pt; do
    [ -e "$model" ] || continue
    enc=$(basename "$model" -s"$seed".pt)
    [ -e "$pending/models/$enc-s$seed.pt" ] || "$python" -c "import sys; from posenc_lab.results import export_models; \
      export_models(sys.argv[1], sys.argv[2], [sys.argv[3]], seed=int(sys.argv[5]), root=sys.argv[4])" \
      "$run" "$(basename "$pending")" "$enc" "$(dirname "$pending")" "$seed"
  done
done
for f in results.csv results.json documents.csv checkpoints.csv; do
  [ -f "$run/$f" ] && cp "$run/$f" "$pending/" || true
done
ls "$pending/units" | wc -l | xargs echo "units in $pending:"

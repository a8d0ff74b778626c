#!/usr/bin/env bash
# Copy the finished units of a long run into a tracked folder, so that a replaced machine loses nothing.
#   scripts/sync_pending.sh RUN_DIR PENDING_DIR      e.g.  scripts/sync_pending.sh runs/article-cpu pending/article-cpu
# To continue the run on a fresh machine:
#   mkdir -p runs && cp -r pending/article-cpu runs/ && python -m posenc_lab run --preset article-cpu --out runs/article-cpu
# (the runner skips every unit whose units/<name>.json exists and refuses a folder made with other options).
# Seed-0 weights are kept (models/*-s0.pt) for the chapters' diagnostics; the other seeds' weights stay in RUN_DIR.
set -euo pipefail
run=${1:?run folder}; pending=${2:?pending folder}
mkdir -p "$pending/units" "$pending/models"
cp "$run/config.json" "$pending/"
cp "$run"/units/*.json "$pending/units/" 2>/dev/null || true
cp "$run"/models/*-s0.pt "$pending/models/" 2>/dev/null || true
for f in results.csv results.json documents.csv checkpoints.csv; do
  [ -f "$run/$f" ] && cp "$run/$f" "$pending/" || true
done
ls "$pending/units" | wc -l | xargs echo "units in $pending:"

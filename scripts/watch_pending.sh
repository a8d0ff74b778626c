#!/usr/bin/env bash
# Commit the finished units of a long run as they land, so that a replaced machine loses nothing.
#   nohup scripts/watch_pending.sh article-long runs/article-long > /dev/null 2>&1 &
# SEEDS (e.g. "0 1 2") is passed on to sync_pending.sh: the seeds whose weights are kept.
# Every minute: when RUN_DIR/units holds more units than pending/NAME/units, copy them with
# scripts/sync_pending.sh and commit pending/NAME alone (other changes in the checkout stay uncommitted).
# Stops when the run's process (matched on "--preset NAME") is gone and every unit is committed.
set -uo pipefail
name=${1:?run name, e.g. article-long}; run=${2:-runs/$name}
cd "$(dirname "$0")/.."
while :; do
  have=$(ls "$run"/units/*.json 2>/dev/null | wc -l)
  done_=$(ls pending/"$name"/units/*.json 2>/dev/null | wc -l)
  if [ "$have" -gt "$done_" ]; then
    scripts/sync_pending.sh "$run" "pending/$name" && git add pending/"$name" &&
      git commit -q -m "pending/$name: $have finished units" -- pending/"$name" || true
  elif ! pgrep -f -- "--preset $name" > /dev/null; then
    exit 0
  fi
  sleep 60
done

#!/usr/bin/env bash
# Commit the finished units of a long run as they land, so that a replaced machine loses nothing.
#   nohup scripts/watch_pending.sh article-long runs/article-long >> runs/article-long.watch.log 2>&1 &
# NAME names pending/NAME; RUN_DIR is the run's --out folder (default runs/NAME; relative to where you call it).
# SEEDS (e.g. "0 1 2") is passed on to sync_pending.sh: the seeds whose weights are kept.
# Every minute: copy the run's finished units with scripts/sync_pending.sh and, when pending/NAME then differs
# from what is committed, commit pending/NAME alone (other changes in the checkout stay uncommitted; a commit
# that fails, e.g. on a held index.lock, is tried again the next minute). When the run's process (the command
# line holding "--out RUN_DIR", RUN_DIR written absolute or relative: any path ending in RUN_DIR's folder name) is
# gone, it syncs and commits once more and stops.
set -uo pipefail
name=${1:?run name, e.g. article-long}; run=${2:-runs/$name}
run=$(realpath -m "$run")
cd "$(dirname "$0")/.."
sync_and_commit() {
  scripts/sync_pending.sh "$run" "pending/$name" > /dev/null || return 1
  if [ -n "$(git status --porcelain -- "pending/$name")" ]; then
    n=$(ls "pending/$name"/units/*.json 2>/dev/null | wc -l)
    git add -- "pending/$name" && git commit -q -m "pending/$name: $n finished units" -- "pending/$name" &&
      echo "$(date -u +%H:%M:%S) committed pending/$name ($n units)"
  fi
}
pattern="--out (\\S*/)?$(basename "$run")/?( |\$)"
while pgrep -f -- "$pattern" > /dev/null; do
  sync_and_commit || echo "$(date -u +%H:%M:%S) sync or commit failed; trying again in a minute"
  sleep 60
done
until sync_and_commit; do echo "$(date -u +%H:%M:%S) last sync or commit failed; trying again"; sleep 60; done
echo "$(date -u +%H:%M:%S) $run is no longer running; pending/$name is committed"

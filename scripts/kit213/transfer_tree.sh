#!/bin/bash
# The device tool sends the checkout (tracked and untracked-not-ignored files) with every call, and a call
# carries at most 64 MiB in all. The tracked tree is ~22 MiB (results/ and the organism in sources/), so a
# 60 MiB kit group fits only while those two stay behind. They are not needed to copy a group out.
#   bash scripts/kit213/transfer_tree.sh slim   # before the 18 transfers: results/ and sources/ stop travelling
#   bash scripts/kit213/transfer_tree.sh full   # before the setup and run calls: everything travels again
# `slim` only unstages the two folders and ignores them in .git/info/exclude; no file is touched, and `full`
# restores the index from HEAD (so stage nothing in between).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=.git/info/exclude
size() { git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {printf "%.1f MiB", s / 1048576}'; }
case "${1:-}" in
  slim)
    git diff --cached --quiet || { echo "error: staged changes would be lost by 'full': commit them first" >&2; exit 2; }
    git rm -r -q --cached results sources
    printf '/results/\n/sources/\n' >> "$exclude"
    echo "transfer tree: slim, $(size) tracked (results/ and sources/ stay behind)" ;;
  full)
    git reset -q
    sed -i '/^\/results\/$/d;/^\/sources\/$/d' "$exclude"
    echo "transfer tree: full, $(size) tracked" ;;
  *) echo "usage: scripts/kit213/transfer_tree.sh slim|full" >&2; exit 2 ;;
esac

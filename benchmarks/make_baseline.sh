#!/usr/bin/env bash
# Exports the baseline commit of the A/B (benchmarks/ab.py) into .baseline/<commit>: the ridge
# package and the benchmark that ab.py runs, from `git archive`, without the demo checkpoints'
# weights (the A/B loads its own checkpoint). The device tool carries it: carry=[".baseline"].
#   bash benchmarks/make_baseline.sh [COMMIT]        (default 5e4f924)
set -euo pipefail
COMMIT=${1:-5e4f924}
cd "$(git rev-parse --show-toplevel)"
DEST=.baseline/$COMMIT
rm -rf "$DEST"
mkdir -p "$DEST"
git archive "$COMMIT" -- ridge benchmarks/fast_path.py pyproject.toml ':(exclude)ridge/assets/*/model.safetensors' \
  | tar -x -C "$DEST"
git rev-parse "$COMMIT" > "$DEST/COMMIT"
KB=$(du -sk .baseline | cut -f1)
echo "$DEST: $(find "$DEST" -type f | wc -l) files, ${KB} KiB"
if [ "$KB" -ge 10240 ]; then
  echo "make_baseline.sh: .baseline is ${KB} KiB, over the 10 MiB the device call should carry" >&2
  exit 1
fi

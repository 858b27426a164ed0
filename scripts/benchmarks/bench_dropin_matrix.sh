#!/usr/bin/env bash
# The drop-in's throughput and delivery under FastDeploy's engine loop, side by side with
# FastDeploy's manager queue: 100 and 200 batches/s offered, GIL-holding and GIL-releasing
# 2 ms steps, the modes alternating in one sitting (--rounds).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-2}
BATCHES=${BATCHES:-300}
MODES=${MODES:-dropin,dropin-sync,dropin@4,dropin-sync@4,fd-manager}
for rate in 100 200; do
  for gil in --gil-step ""; do
    python3 scripts/benchmarks/bench_dropin.py --tp 2 --rate "$rate" --batches "$BATCHES" $gil \
      --modes "$MODES" --rounds "$ROUNDS"
    echo
  done
done

#!/usr/bin/env bash
# Runs bench_scaling.py at 1, 2 and 4 ranks (1 thread per rank) and at 1 rank x 2 threads,
# REPEATS times over (interleaved, to see through a noisy machine), then merges the runs
# into bench_out/scaling.json, a table on stdout and bench_out/scaling.png.
#
#   benchmarks/run_scaling.sh                  # full W1, 3 passes (about 2 minutes here)
#   REPEATS=1 benchmarks/run_scaling.sh --rows 20000 --steps 10   # quick
#
# Extra arguments go to every bench_scaling.py run. On a 2-core machine 4 ranks oversubscribe.
# sokrun gets OMP_NUM_THREADS = the threads per rank, so that its own rule decides binding:
# a rank with 2 threads runs unbound (sokrun adds --bind-to none), 1-thread ranks stay bound.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
SOKRUN="$VENV/bin/sokrun"
PY="$VENV/bin/python"
OUT=${OUT:-bench_out}
REPEATS=${REPEATS:-3}
EXTRA=("$@")
mkdir -p "$OUT/scaling_runs"
rm -f "$OUT"/scaling_runs/*.json
files=()
for rep in $(seq 1 "$REPEATS"); do
  for cfg in "1 1" "2 1" "4 1" "1 2"; do
    read -r np th <<< "$cfg"
    f="$OUT/scaling_runs/np${np}_t${th}_rep${rep}.json"
    echo "== ${np} rank(s) x ${th} thread(s), pass ${rep}/${REPEATS}"
    OMP_NUM_THREADS="$th" "$SOKRUN" -np "$np" --timeout 900 python benchmarks/bench_scaling.py --threads "$th" --per-kernel --out "$f" ${EXTRA[@]+"${EXTRA[@]}"}
    files+=("$f")
  done
done
"$PY" benchmarks/bench_scaling.py --merge "${files[@]}" --merged-out "$OUT/scaling.json"

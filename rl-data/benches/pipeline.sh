#!/usr/bin/env bash
# Prompt-pipeline benchmark: load + render + tokenise + left-pad N GSM8K-sized prompts, in Rust
# (rl-data) and in Python (pyarrow + transformers' chat template + tokenizers) in the same run,
# on the same parquet file and tokenizer; prints both figures and the ratio, and checks that both
# produced the same tokens (count and id checksum).
#
# It runs the pair twice: on all CPUs (Rust encodes on one thread per CPU, the Python tokenizer's
# batch call on rayon's pool), then with both processes pinned to CPU 0 by `taskset` (one thread
# each), and prints the load average around each pair.
#
# Both halves run with OMP_NUM_THREADS=1 unless it is set: their torch ops (collation, the
# checksums) then use one intra-op thread, as in a PyTorch DataLoader worker, where verl's
# dataset and collate_fn run. On a shared 2-core machine OpenMP's spinning workers otherwise
# slow both halves several-fold (run with OMP_NUM_THREADS=2 to see it).
#
# Usage: rl-data/benches/pipeline.sh [TOKENIZER_DIR] [ROWS]
#   TOKENIZER_DIR defaults to models/smollm2-135m-instruct (scripts/import-smollm2 makes it);
#   ROWS defaults to 100000. Needs .venv (scripts/reference-env).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tok=${1:-"$root/models/smollm2-135m-instruct"}
rows=${2:-100000}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$root"
cargo build --release -q -p rl-data --example pipeline_bench
bin="$root/target/release/examples/pipeline_bench"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" gen "$tmp/prompts.parquet" "$rows" >/dev/null

loadavg() { cut -d' ' -f1-3 /proc/loadavg; }

# pair LABEL [PREFIX...]: runs both halves under PREFIX (e.g. taskset -c 0) and compares them.
pair() {
  local label=$1
  shift
  local before rust python
  before=$(loadavg)
  rust=$("$@" "$bin" run "$tmp/prompts.parquet" "$tok")
  python=$("$@" "$root/.venv/bin/python" "$root/rl-data/benches/pipeline_python.py" \
    "$tmp/prompts.parquet" "$tok")
  echo "$rust"
  echo "$python"
  python3 - "$label" "$rust" "$python" "$before" "$(loadavg)" "$OMP_NUM_THREADS" <<'PY'
import json, sys
label, r, p = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
same = (r["rows"], r["tokens"], r["checksum"]) == (p["rows"], p["tokens"], p["checksum"])
print(f"{label}: rust {r['rows_per_s']:.0f} rows/s, python {p['rows_per_s']:.0f} rows/s, "
      f"ratio {r['rows_per_s'] / p['rows_per_s']:.2f}x, identical tokens: {same} "
      f"(load average {sys.argv[4]} before, {sys.argv[5]} after; OMP_NUM_THREADS={sys.argv[6]})")
sys.exit(0 if same else 1)
PY
}

pair "all $(getconf _NPROCESSORS_ONLN) CPUs"
if command -v taskset >/dev/null; then
  pair "one CPU (taskset -c 0)" taskset -c 0
fi

#!/usr/bin/env bash
# Prompt-pipeline benchmark: load + render + tokenise + left-pad N GSM8K-sized prompts, in Rust
# (rl-data) and in Python (pyarrow + transformers' chat template + tokenizers) in the same run,
# on the same parquet file and tokenizer; prints both figures and the ratio, and checks that both
# produced the same tokens (count and id checksum).
# Usage: rl-data/benches/pipeline.sh [TOKENIZER_DIR] [ROWS]
#   TOKENIZER_DIR defaults to models/smollm2-135m-instruct (scripts/import-smollm2 makes it);
#   ROWS defaults to 100000. Needs .venv (scripts/reference-env).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tok=${1:-"$root/models/smollm2-135m-instruct"}
rows=${2:-100000}
cd "$root"
cargo build --release -q -p rl-data --example pipeline_bench
bin="$root/target/release/examples/pipeline_bench"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" gen "$tmp/prompts.parquet" "$rows" >/dev/null
rust=$("$bin" run "$tmp/prompts.parquet" "$tok")
python=$("$root/.venv/bin/python" "$root/rl-data/benches/pipeline_python.py" "$tmp/prompts.parquet" "$tok")
echo "$rust"
echo "$python"
python3 - "$rust" "$python" <<'PY'
import json, sys
r, p = json.loads(sys.argv[1]), json.loads(sys.argv[2])
same = (r["rows"], r["tokens"], r["checksum"]) == (p["rows"], p["tokens"], p["checksum"])
print(f"rust {r['rows_per_s']:.0f} rows/s, python {p['rows_per_s']:.0f} rows/s, "
      f"ratio {r['rows_per_s'] / p['rows_per_s']:.2f}x, identical tokens: {same}")
sys.exit(0 if same else 1)
PY

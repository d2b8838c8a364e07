#!/usr/bin/env bash
# The GPU run of the benchmark suite as one prepared command for a lent device machine (a bare image with CUDA
# torch, numpy and matplotlib, without torchdata, webdataset and tqdm, and no network).
#
# Here, once (.gitignore keeps the wheels out of git; they travel with `carry: [".whl"]`):
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl torchdata==0.11.0 webdataset==1.0.2 braceexpand==0.1.7 \
#     tqdm==4.70.1
# There:  bash benchmarks/device_run.sh            (extra arguments go to `python -m benchmarks`)
# It writes the results into $OUT as one archive (the device returns at most 8 files) and prints the table.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/loader-bench}"
results="$(mktemp -d)"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/loader-site .whl/*.whl
export PYTHONPATH="/tmp/loader-site:$PWD" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
python3 -m benchmarks --quick --device "${DEVICE:-cuda}" --out "$results" "$@" 2>&1 | tail -n 40
tar -czf "$out/benchmark-results.tgz" -C "$results" .
cat "$results"/*.md

#!/usr/bin/env bash
# The GPU benchmark as one prepared command for a lent device machine (a bare image with CUDA torch, numpy and
# matplotlib, without torchdata, webdataset and tqdm, and no network). It runs exactly the training section
# (benchmarks/training.py): an MLP's step with each loader against the same steps on batches already on the GPU
# (the limit), pinned memory on and off, our loader with and without state_dict() every step.
#
# Here, once (.gitignore keeps the wheels out of git; they travel with `carry: [".whl"]`):
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl torchdata==0.11.0 webdataset==1.0.2 braceexpand==0.1.7 \
#     tqdm==4.70.1
# There:  bash benchmarks/device_run.sh            (extra arguments go to `python -m benchmarks`)
# It writes the results into $OUT as one archive (the device returns at most 8 files) and prints the table.
# Back here, publish them beside the CPU results:  bash benchmarks/device_run.sh --publish ARCHIVE
#   (into benchmarks/results, or $RESULTS; the files are named cuda-<gpu>-training.*, the CPU ones cpu-<host>*)
# Dry run on a CPU (the same path, tiny sizes):
#   DEVICE=cpu MODE=--smoke OUT=/tmp/d bash benchmarks/device_run.sh && \
#     RESULTS=/tmp/d bash benchmarks/device_run.sh --publish /tmp/d/benchmark-results.tgz
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--publish" ]]; then  # unpack a device run's archive into benchmarks/results (its own names)
  tar -xzf "$2" -C "${RESULTS:-benchmarks/results}" --wildcards '*.json' '*.md' '*.png'
  ls -1 "${RESULTS:-benchmarks/results}"
  exit 0
fi
out="${OUT:-/tmp/loader-bench}"
results="$(mktemp -d)"
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then  # the carried wheels; a machine that has the packages needs none
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/loader-site .whl/*.whl
fi
export PYTHONPATH="/tmp/loader-site:$PWD" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
python3 -m benchmarks "${MODE:---quick}" --device "${DEVICE:-cuda}" --sections training --out "$results" "$@" \
  2>&1 | tail -n 40
tar -czf "$out/benchmark-results.tgz" -C "$results" .
cat "$results"/*.md

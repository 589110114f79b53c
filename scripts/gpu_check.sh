#!/usr/bin/env bash
# GPU check, for a machine with NVIDIA GPUs and this project set up (bash scripts/setup.sh, with
# SGPU_TORCH_SPEC naming a CUDA build of torch): the GPU-marked tests, every notebook unchanged
# (one rank per GPU; on a one-GPU machine they run 1 rank with nccl) with its wall time, and the
# benchmark suite's --gpu section. Prints one line per notebook: "<notebook>: ok in N s".
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
export PYTHONUNBUFFERED=1
"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPU(s)')" || exit 1
status=0
"$py" -m pytest -q -m gpu tests -p no:cacheprovider || status=1
for nb in notebooks/0*_*.ipynb; do
    case "$nb" in *.out.ipynb) continue ;; esac
    "$py" scripts/run_notebook.py "$nb" > "/tmp/$(basename "$nb").log" 2>&1 || status=1
    tail -n 1 "/tmp/$(basename "$nb").log"
done
"$py" -m benchmarks.run --gpu --quick --only gpu || status=1
exit $status

#!/usr/bin/env bash
# GPU check, for a machine with NVIDIA GPUs: the GPU-marked tests, the benchmark suite's --gpu
# section, and notebooks unchanged (one rank per GPU; on a one-GPU machine they run 1 rank with
# nccl), each with its wall time. Prints one line per step: "<step>: ok|FAILED in N s".
#
# Where the project is set up (bash scripts/setup.sh with SGPU_TORCH_SPEC naming a CUDA build of
# torch) it runs with .venv/bin/python. On a machine whose python already has a CUDA torch but not
# IPython, ipywidgets, jupyter_client or mlflow, put their wheels in .whl/ (ignored by git) and run
#     PYTHON=python3 bash scripts/gpu_check.sh
# the wheels are installed into /tmp/site (no network needed) and the project runs from the
# checkout through PYTHONPATH. Logs and the benchmark's JSON go to $OUT (else /tmp/gpu_check).
#   SGPU_GPU_NOTEBOOKS   notebooks to run (default: every notebook but DeepSpeed's and Ray's,
#                        whose packages such a machine may lack)
#   SGPU_GPU_EXTRA       extra benchmark sections to run after the GPU one (e.g. "launch")
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    t0=$SECONDS
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        > "$out/pip.log" 2>&1 || { echo "installing .whl/ failed:"; tail -n 20 "$out/pip.log"; exit 1; }
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="/tmp/site/bin:$PATH"
    echo "wheels: $(ls .whl/*.whl | wc -l) installed into /tmp/site in $((SECONDS - t0)) s"
fi
"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPU(s)')" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
echo "cpus: $(nproc)"
status=0
step() {  # step NAME LIMIT_S CMD...: run CMD with a time limit, log to $out/NAME.log, print one line
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    if [ $rc = 0 ]; then echo "$name: ok in $((SECONDS - t0)) s"; else
        echo "$name: FAILED (rc $rc) in $((SECONDS - t0)) s"; tail -n 25 "$out/$name.log"; status=1; fi
}
step gpu_tests 180 "$py" -m pytest -q -m gpu tests/integration/test_gpu.py -p no:cacheprovider -o addopts="" -rA
step bench_gpu 300 "$py" -m benchmarks.run --gpu --quick --only gpu --json "$out/bench_gpu.json"
grep -A 12 "^### 5. GPU" "$out/bench_gpu.log" | head -n 14
notebooks=${SGPU_GPU_NOTEBOOKS:-$(ls notebooks/0*_*.ipynb | grep -v -e '\.out\.ipynb$' -e deepspeed -e ray)}
for nb in $notebooks; do
    step "$(basename "$nb" .ipynb)" 240 "$py" scripts/run_notebook.py "$nb"
done
for extra in ${SGPU_GPU_EXTRA:-}; do
    step "bench_$extra" 300 "$py" -m benchmarks.run --quick --only "$extra" --json "$out/bench_$extra.json"
done
exit $status

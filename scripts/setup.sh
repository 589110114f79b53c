#!/usr/bin/env bash
# Set up everything sgpu_magic needs in ./.venv on a fresh Linux machine with Python 3.10+ and pip.
# torch is installed first, pinned, so pip does not pick a different (multi-GB) build on its own;
# set SGPU_TORCH_SPEC to choose another torch (e.g. a CUDA build on a GPU machine). DeepSpeed (an optional
# extra of the package) is installed too: notebooks/03_deepspeed.ipynb runs in the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check "${SGPU_TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,deepspeed]"

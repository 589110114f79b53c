#!/usr/bin/env bash
# Set up everything sgpu_magic needs in ./.venv on a fresh Linux machine with Python 3.10+ and pip.
# torch is installed first, pinned, so pip does not pick a different (multi-GB) build on its own;
# set SGPU_TORCH_SPEC to choose another torch (e.g. a CUDA build on a GPU machine). DeepSpeed (an optional
# extra of the package) is installed too: notebooks/03_deepspeed.ipynb runs in the test suite. So are JupyterLab
# and Playwright (the "browser" extra) and, when run as root with apt-get, Debian's chromium, for the panel's
# end-to-end tests in tests/browser (skipped, saying why, where chromium cannot be installed; no browser is
# downloaded by Playwright). SGPU_SKIP_CHROMIUM=1 skips the apt-get step.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check "${SGPU_TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,deepspeed,browser,ray]"
if [ "${SGPU_SKIP_CHROMIUM:-0}" != 1 ] && [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        log=$(mktemp)
        if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >"$log" 2>&1 ||
               { apt-get update -q >>"$log" 2>&1 &&
                 DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >>"$log" 2>&1; }; }; then
            echo "setup: Debian's chromium could not be installed (see $log); the browser tests will be skipped"
        fi
    else
        echo "setup: not root or no apt-get: install Debian's chromium (/usr/bin/chromium) for the browser tests"
    fi
fi

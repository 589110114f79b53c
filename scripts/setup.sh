#!/usr/bin/env bash
# Set up everything sgpu_magic needs in ./.venv on a fresh Linux machine with Python 3.10+ and pip.
# torch is installed first, pinned, so pip does not pick a different (multi-GB) build on its own;
# set SGPU_TORCH_SPEC to choose another torch (e.g. a CUDA build on a GPU machine). DeepSpeed (an optional
# extra of the package) is installed too: notebooks/03_deepspeed.ipynb runs in the test suite. So are JupyterLab
# and Playwright (the "browser" extra) and, when run as root with apt-get, Debian's chromium, for the panel's
# end-to-end tests in tests/browser (skipped, saying why, where chromium cannot be installed; no browser is
# downloaded by Playwright). SGPU_SKIP_CHROMIUM=1 skips the apt-get step. The "docs" extra (MkDocs, Material,
# mkdocstrings, mkdocs-jupyter) builds the documentation site: .venv/bin/mkdocs build --strict.
#
# Each step prints one line with its time; what pip and apt-get say goes to .venv/setup-logs/<step>.log and is
# shown only when the step fails (without pip's "Location ... is ignored" lines), and then setup stops.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
torch_spec=${SGPU_TORCH_SPEC:-torch==2.13.0}
extras="test,deepspeed,browser,ray,docs"
logs=.venv/setup-logs
pip=(.venv/bin/python -m pip install --disable-pip-version-check)
setup_started=$SECONDS

# show_log LOG: the log of a failed step, pip's "Location '...' is ignored" warnings (one per index and package
# looked up) left out, at most its last 200 lines
show_log() {
    local kept
    kept=$(grep -v "^WARNING: Location '.*' is ignored" "$1" || true)
    if [ "$(printf '%s\n' "$kept" | wc -l)" -gt 200 ]; then
        echo "setup: ... the last 200 lines of $1 (pip's 'Location ... is ignored' warnings left out):"
        kept=$(printf '%s\n' "$kept" | tail -n 200)
    else
        echo "setup: $1 (pip's 'Location ... is ignored' warnings left out):"
    fi
    printf '%s\n' "$kept" | sed 's/^/    /'
}

# step WHAT LOG COMMAND...: run COMMAND with its output in LOG, saying "setup: WHAT ... done (N s)";
# on failure say so, show LOG and return COMMAND's exit status
step() {
    local what=$1 log=$2 started=$SECONDS code=0
    shift 2
    printf 'setup: %s ... ' "$what"
    "$@" >"$log" 2>&1 || code=$?
    if [ "$code" = 0 ]; then
        printf 'done (%d s)\n' $((SECONDS - started))
    else
        printf 'FAILED (exit code %d, %d s)\n' "$code" $((SECONDS - started))
        show_log "$log"
    fi
    return "$code"
}

if [ -x .venv/bin/python ]; then
    mkdir -p "$logs"
    echo "setup: using the existing .venv ($(.venv/bin/python -V))"
else
    first_log=$(mktemp)
    step "creating .venv with $python ($("$python" -V 2>&1))" "$first_log" "$python" -m venv .venv || exit $?
    mkdir -p "$logs"
    mv "$first_log" "$logs/venv.log"
fi
step "upgrading pip" "$logs/pip.log" "${pip[@]}" --upgrade pip || exit $?
step "installing ${torch_spec/==/ }" "$logs/torch.log" \
    "${pip[@]}" "$torch_spec" || exit $?
echo "setup: installed $(.venv/bin/python -W ignore -c 'import torch; print(f"torch {torch.__version__},",
    f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build")')"
step "installing the package and its extras (${extras//,/, })" "$logs/package.log" "${pip[@]}" -e ".[$extras]" || exit $?

if [ "${SGPU_SKIP_CHROMIUM:-0}" = 1 ]; then
    echo "setup: chromium for the browser tests: skipped (SGPU_SKIP_CHROMIUM=1); those tests will be skipped"
elif [ -x /usr/bin/chromium ]; then
    echo "setup: chromium for the browser tests: /usr/bin/chromium is there"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    # another apt-get or an unattended upgrade may hold dpkg's lock: wait for it (up to 5 minutes) instead of failing
    apt=(apt-get -o DPkg::Lock::Timeout=300)
    apt_install() {
        DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -q chromium ||
            { "${apt[@]}" update -q && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -q chromium; }
    }
    step "installing chromium for the browser tests (apt-get)" "$logs/chromium.log" apt_install ||
        echo "setup: Debian's chromium could not be installed; the browser tests will be skipped"
else
    echo "setup: chromium for the browser tests: not root or no apt-get: install Debian's chromium" \
         "(/usr/bin/chromium), or the browser tests will be skipped"
fi
echo "setup: ready in $((SECONDS - setup_started)) s: .venv/bin/python; each step's log is in $logs/"

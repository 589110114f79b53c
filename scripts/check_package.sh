#!/usr/bin/env bash
# The packaging check that CI runs (.ci/run): what a user gets from `pip install sgpu_magic` works.
#
# 1. builds the sdist and, from it, the wheel (python -m build, in an isolated build environment) out of a copy of
#    the working tree's files that git does not ignore, so nothing is written into the checkout;
# 2. twine check --strict on both (metadata, the README renders on PyPI);
# 3. the wheel holds the package only (sgpu_magic/ and its .dist-info: no tests, benchmarks, notebooks), with
#    py.typed and the LICENSE; the sdist has no tests either;
# 4. installs the wheel with --no-deps into a fresh venv that sees this venv's packages through a .pth file (so the
#    multi-GB CUDA torch a plain `torch` requirement pulls is never downloaded), checks that its dependencies are
#    met (pip check) and that sgpu_magic is imported from the wheel, not from the checkout;
# 5. there, in an IPython shell: %load_ext sgpu_magic, a 1-rank job through the decorator, %distributed_doctor;
#    then `python -m sgpu_magic doctor`, which must find no error.
# Everything goes to a temporary directory, removed at the end (KEEP=1 keeps it). Usage: bash scripts/check_package.sh
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
python=${PYTHON:-$repo/.venv/bin/python}
work=$(mktemp -d "${TMPDIR:-/tmp}/sgpu_check_package.XXXXXX")
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
step() { printf 'check_package: %s\n' "$*"; }
started=$SECONDS

step "copying the source tree to $work/src"
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} sh -c 'test -e "{}" && printf "%s\0" "{}"' \
    | tar --null -T - -cf - | tar -xf - -C "$work/src"

step "building the sdist and the wheel"
"$python" -m build --outdir "$work/dist" "$work/src" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/*.whl)
sdist=$(ls "$work"/dist/*.tar.gz)

step "twine check --strict"
"$python" -m twine check --strict "$wheel" "$sdist"

step "wheel and sdist contents"
"$python" - "$wheel" "$sdist" <<'EOF'
import re
import sys
import tarfile
import zipfile

wheel, sdist = sys.argv[1], sys.argv[2]
names = zipfile.ZipFile(wheel).namelist()
stray = [n for n in names if not re.match(r"sgpu_magic/|sgpu_magic-[^/]+\.dist-info/", n)]
missing = [n for n in ("sgpu_magic/__init__.py", "sgpu_magic/__main__.py", "sgpu_magic/py.typed",
                       "sgpu_magic/front/doctor/__init__.py", "sgpu_magic/rank/worker.py") if n not in names]
if not any(re.fullmatch(r"sgpu_magic-[^/]+\.dist-info/licenses/LICENSE", n) for n in names):
    missing.append("<dist-info>/licenses/LICENSE")
sdist_tests = [n for n in tarfile.open(sdist).getnames() if "/tests/" in n or n.endswith("/tests")]
if stray or missing or sdist_tests:
    sys.exit(f"check_package: the wheel has files outside the package: {stray}; it lacks: {missing}; "
             f"the sdist has tests: {sdist_tests}")
print(f"check_package: the wheel holds {len(names)} files, all under sgpu_magic/ and its dist-info")
EOF

step "installing the wheel into a fresh venv (--no-deps; this venv's packages through a .pth file)"
"$python" -m venv --without-pip "$work/venv"
fresh="$work/venv/bin/python"
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
fresh_site=$("$fresh" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# only the directory is added: the .pth files in it (the checkout's editable install among them) are not run
printf '%s\n' "$site" >"$fresh_site/zz_sgpu_check_deps.pth"
"$python" -m pip --python "$fresh" install -q --disable-pip-version-check --no-deps --no-index "$wheel"
"$python" -m pip --python "$fresh" check --disable-pip-version-check

mkdir "$work/run"
cd "$work/run"  # not the checkout: sgpu_magic must come from the wheel
export SGPU_MAGIC_HOME="$work/home" MLFLOW_TRACKING_URI="sqlite:///$work/run/mlflow.db" SGPU_MAGIC_WIDGETS=0
"$fresh" - "$fresh_site" <<'EOF'
import sys
from importlib.metadata import version
from pathlib import Path

import sgpu_magic

where = Path(sgpu_magic.__file__).resolve()
if Path(sys.argv[1]).resolve() not in where.parents:
    sys.exit(f"check_package: sgpu_magic was imported from {where}, not from the installed wheel")
if sgpu_magic.__version__ != version("sgpu_magic"):
    sys.exit(f"check_package: __version__ {sgpu_magic.__version__} is not the metadata's {version('sgpu_magic')}")
print(f"check_package: sgpu_magic {sgpu_magic.__version__} imported from {where.parent}")
EOF

step "IPython: %load_ext sgpu_magic, a 1-rank job, %distributed_doctor"
"$fresh" -m IPython --no-banner --quick --colors=NoColor -c '
%load_ext sgpu_magic
from sgpu_magic import distributed
answer = distributed(gpus=1, mlflow=False)(lambda: 41 + 1).distributed()
assert answer == [42], answer
report = %distributed_doctor
assert report.ok, report
print("check_package: the extension loaded, a rank returned", answer, "and", report.summary())
' >"$work/ipython.log" 2>&1 || { cat "$work/ipython.log"; exit 1; }
grep '^check_package:' "$work/ipython.log"

step "python -m sgpu_magic doctor"
"$fresh" -m sgpu_magic doctor || { step "the doctor found an error (above)"; exit 1; }
step "passed in $((SECONDS - started)) s"

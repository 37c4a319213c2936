#!/usr/bin/env bash
# The build steps of docker/Dockerfile, kept in one script so CI runs exactly them outside Docker
# (tests/docker/test_docker.py): install this package without touching the image's dependencies,
# apply the source patches to the installed sglang==0.5.23 and check them, smoke-test the entry point.
#
#   bash docker/setup.sh SRC_DIR            # in the image: SRC_DIR=/opt/treespec-sglang
#   TREESPEC_PATCH_SITE=DIR bash docker/setup.sh SRC_DIR   # patch a copy of sglang under DIR instead
#   TREESPEC_PIP_ARGS="--target DIR" ...                    # extra pip install arguments (tests)
set -euo pipefail
src="${1:?usage: setup.sh SRC_DIR}"
site_args=()
if [[ -n "${TREESPEC_PATCH_SITE:-}" ]]; then
    site_args=(--site "$TREESPEC_PATCH_SITE")
fi

read -r -a pip_args <<< "${TREESPEC_PIP_ARGS:-}"
python -m pip install --no-cache-dir --no-deps "${pip_args[@]}" "$src"
treespec patch apply "${site_args[@]}"
treespec patch check "${site_args[@]}"
treespec bench-server --help > /dev/null
python - <<'PY'
from importlib.metadata import entry_points
eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "treespec"]
assert eps, "the sglang.srt.plugins entry point 'treespec' is not installed"
eps[0].load()
print("treespec-sglang installed; plugin entry point:", eps[0].value)
PY

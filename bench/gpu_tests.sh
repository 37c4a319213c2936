#!/usr/bin/env bash
# The GPU tests (pytest -m gpu) one file per process, each under its own limit, so a file that hangs costs its
# limit and not the device call; verbose, with faulthandler_timeout, so a stuck test names itself and dumps its
# stack. Collection runs alone first, under its own limit, for the same reason. Exit status: the last failure's.
#   bash bench/gpu_tests.sh [PATH...]     (default: tests/plugin tests/training tests/attention)
#   GPU_TEST_FILE_S (default 90): each file's limit in seconds
set -uo pipefail
paths=("$@")
[ ${#paths[@]} -gt 0 ] || paths=(tests/plugin tests/training tests/attention)
files=$(timeout -k 10 60 python -m pytest -q -m gpu --collect-only -p no:cacheprovider "${paths[@]}" \
    | grep "::" | cut -d: -f1 | sort -u)
rc=${PIPESTATUS[0]}
echo "gpu tests: collected in files: $(echo $files) (collection rc $rc)"
[ -n "$files" ] || exit "${rc/#0/1}"
for f in $files; do
    timeout -k 10 "${GPU_TEST_FILE_S:-90}" python -m pytest -v -m gpu "$f" -p no:cacheprovider -o faulthandler_timeout=60
    r=$?
    echo "gpu tests: $f rc $r"
    [ $r = 0 ] || rc=$r
done
exit $rc

#!/usr/bin/env bash
# The GPU tests (pytest -m gpu) one file per process, each under its own limit, so a file that hangs costs its
# limit and not the device call; verbose, with faulthandler_timeout, so a stuck test names itself and dumps its
# stack. Collection runs alone first, under its own limit, for the same reason. Exit status: the last failure's
# (124: a limit was hit).
#   bash bench/gpu_tests.sh [PATH...]     (default: tests/plugin tests/training tests/attention tests/utils)
#   GPU_TEST_FILE_S (default 90): one file's limit; GPU_TESTS_S (default 300): the whole run's, after which no
#   file starts and a running one gets only what is left (an outer `timeout` cannot reach the files' own
#   timeouts, each in its own process group: TERM is passed on to the file running)
set -uo pipefail
paths=("$@")
[ ${#paths[@]} -gt 0 ] || paths=(tests/plugin tests/training tests/attention tests/utils)
deadline=$((SECONDS + ${GPU_TESTS_S:-300}))
child=
trap '[ -n "$child" ] && kill -TERM "$child" 2>/dev/null; wait; exit 124' TERM INT
collected=$(timeout -k 10 60 python -m pytest -q -m gpu --collect-only -p no:cacheprovider "${paths[@]}")
rc=$?
files=$(printf '%s\n' "$collected" | grep "::" | cut -d: -f1 | sort -u)
echo "gpu tests: collected in files: $(echo $files) (collection rc $rc)"
[ -n "$files" ] || exit "${rc/#0/1}"
for f in $files; do
    left=$((deadline - SECONDS))
    if [ $left -le 0 ]; then echo "gpu tests: $f not run (GPU_TESTS_S spent)"; rc=124; continue; fi
    limit=${GPU_TEST_FILE_S:-90}
    [ $left -lt "$limit" ] && limit=$left
    timeout -k 10 "$limit" python -m pytest -v -m gpu "$f" -p no:cacheprovider -o faulthandler_timeout=60 &
    child=$!
    wait "$child"
    r=$?
    child=
    echo "gpu tests: $f rc $r"
    [ $r = 0 ] || rc=$r
done
exit $rc

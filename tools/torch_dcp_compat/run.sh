#!/usr/bin/env bash
# Run PyTorch's DCP tests (a local copy, see README.md) with and without the dcp_plus patch.
#
#   tools/torch_dcp_compat/run.sh TESTS_DIR OUT_DIR [MODE...] [-- PYTEST_ARGS...]
#
# MODE: "on" (patched) and/or "off" (stock DCP); default both. Each test file runs in its own
# pytest process (one hang cannot take the others down), leaving OUT_DIR/MODE/NAME.{xml,log}.
# Environment: FILES (test files relative to TESTS_DIR; default every test_*.py),
# DCP_PLUS_SRC (a directory holding the dcp_plus package to test, e.g. a `git archive HEAD`
# export; default this checkout), EXTRA_PYTHONPATH (e.g. where expecttest is installed),
# TEST_TIMEOUT (s per test, default 300), FILE_TIMEOUT (s per file, default 1800),
# PYTHON (default REPO/.venv/bin/python).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
tests=$(cd "$1" && pwd); out=$(mkdir -p "$2" && cd "$2" && pwd); shift 2
modes=()
while [[ $# -gt 0 && $1 != -- ]]; do modes+=("$1"); shift; done
[[ ${1:-} == -- ]] && shift
[[ ${#modes[@]} -eq 0 ]] && modes=(on off)
py=${PYTHON:-$repo/.venv/bin/python}
export PYTHONPATH="${DCP_PLUS_SRC:+$DCP_PLUS_SRC:}$repo${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}"
files=${FILES:-$(cd "$tests" && find . -name 'test_*.py' | sed 's|^\./||' | sort)}
cd "$tests"  # not the repo root: its dcp_plus must not shadow DCP_PLUS_SRC
for mode in "${modes[@]}"; do
  mkdir -p "$out/$mode"
  for f in $files; do
    name=${f//\//__}; name=${name%.py}
    echo "== $mode $f"
    rc=0
    timeout "${FILE_TIMEOUT:-1800}" "$py" -m pytest "$f" -p tools.torch_dcp_compat.plugin \
      --dcp-compat="$mode" --timeout "${TEST_TIMEOUT:-300}" -q -rfEs -p no:cacheprovider \
      --junitxml "$out/$mode/$name.xml" "$@" >"$out/$mode/$name.log" 2>&1 || rc=$?
    tail -n 1 "$out/$mode/$name.log"; [[ $rc -le 1 ]] || echo "   (exit $rc)"
  done
done

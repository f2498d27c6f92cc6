#!/usr/bin/env bash
# The test command of the README (and of CI, .ci/run): install the package with its test extras,
# make sure the browser test has a chromium (Debian's; installed with apt-get where we may, else a
# clear message), then run the whole suite. Extra arguments go to pytest (e.g. -x -k gguf).
set -uo pipefail
cd "$(dirname "$0")/.."
export TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python}

"$PY" -m pip install torch==2.13.0 -e ".[dev]" || exit $?

# the web chat page test drives a system chromium through playwright (never a downloaded browser)
if ! command -v chromium >/dev/null 2>&1; then
  echo "scripts/test.sh: chromium not found; installing Debian's chromium (apt-get) ..." >&2
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || true
  elif command -v sudo >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || true
  fi
  if ! command -v chromium >/dev/null 2>&1; then
    echo "scripts/test.sh: could not install chromium: install it (e.g. 'apt-get install chromium')," \
         "or run 'python -m pytest -m \"not browser\"' to leave the browser test out." >&2
    exit 1
  fi
fi

"$PY" -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing on purpose" >&2; exit 1; fi
exit "$rc"

#!/usr/bin/env bash
# The test command (README, CI): builds the CPU environment if needed, then runs the whole suite.
# Kernels run under Triton's interpreter on CPU (TRITON_INTERPRET=1 is set by their tests when no GPU is present).
# pytest exit code 5 ("no tests ran") counts as a failure.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup_env.sh || exit 1
.venv/bin/python -m pytest --version >/dev/null || exit 1
# not `python -m pytest`: that would put the repository root on sys.path (see tests/conftest.py)
# the 15 slowest tests at the end of the output: where to make the suite faster (CI keeps it under ~50 minutes)
.venv/bin/pytest -q --durations=15 "$@"
rc=$?
if [[ $rc == 5 ]]; then echo "no tests ran: failing" >&2; exit 1; fi
exit $rc

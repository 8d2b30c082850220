#!/usr/bin/env bash
# Mutation testing of the protocol- and security-critical modules ([tool.mutmut] in
# pyproject.toml): mutmut plants one small bug at a time (a flipped comparison, a removed
# check, a changed constant) and runs the fast tests that cover it; a mutant that no test
# notices is a bug the suite would let through. Then a per-module score.
#
#   tools/mutation.sh                 # every module (about 8,800 mutants, about 30 minutes on 2 cores)
#   tools/mutation.sh 'mlxcel.wire.frames*'   # mutants whose name matches
#
# Needs `pip install -e ".[mutation]"` (mutmut 3.8.1; not a test extra: CI does not run
# it). Results stay in mutants/ (git-ignored) between runs: only mutants of changed
# functions run again.
set -euo pipefail
cd "$(dirname "$0")/.."
mutmut run --max-children "${MUTMUT_CHILDREN:-2}" "$@" >/dev/null 2>&1 || true
python tools/mutation_report.py

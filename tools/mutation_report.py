"""Per-module mutation score from mutmut's results in mutants/ (see tools/mutation.sh).

    python tools/mutation_report.py [--survivors]

Killed counts timeouts and crashes (a mutant that hangs or breaks the run was noticed);
"no tests" are mutants in code that none of the selected tests reaches. The score is killed
over (killed + survived + no tests). ``--survivors`` lists the surviving mutants' names, for
``mutmut show NAME``.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

KILLED = {1, 3, 24, -24, 36, 152, 255, -9, -11}
SURVIVED = {0}
NO_TESTS = {5, 33}


def main() -> int:
    root = Path(__file__).resolve().parent.parent / "mutants"
    metas = sorted(root.rglob("*.py.meta"))
    if not metas:
        print("no results: run tools/mutation.sh first", file=sys.stderr)
        return 1
    rows, survivors = [], []
    for meta in metas:
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        if not codes:
            continue
        c: Counter[str] = Counter()
        for name, code in codes.items():
            kind = (
                "killed"
                if code in KILLED
                else "survived"
                if code in SURVIVED
                else "no tests"
                if code in NO_TESTS
                else "not run"
                if code is None
                else "other"
            )
            c[kind] += 1
            if kind == "survived":
                survivors.append(name)
        module = str(meta.relative_to(root)).removesuffix(".meta")
        judged = c["killed"] + c["survived"] + c["no tests"]
        score = 100.0 * c["killed"] / judged if judged else 0.0
        rows.append((module, len(codes), c, score))
    print("| module | mutants | killed | survived | no tests | not run | score |")
    print("|---|---|---|---|---|---|---|")
    for module, total, c, score in rows:
        print(
            f"| {module} | {total} | {c['killed']} | {c['survived']} | {c['no tests']} "
            f"| {c['not run'] + c['other']} | {score:.1f}% |"
        )
    if "--survivors" in sys.argv:
        print("\n".join(sorted(survivors)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Settings are passed, not fetched: below the command line and the config layer nothing
reads the environment, except where the environment is the contract itself (listed here,
each with why)."""

from __future__ import annotations

import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "mlxcel"
READ = re.compile(r"os\.environ(?!\[\S+\]\s*=)(?!\.(?:update|setdefault|pop)\()|os\.getenv\(")
# Where the environment is read on purpose: the surfaces that parse it into settings.
CONFIG_LAYER = ("config/", "process/home.py", "cli/", "bench/")
CONTRACTS = {
    # The OS's contract: which GPUs this process may use.
    "runtime/devices.py": "CUDA_VISIBLE_DEVICES",
    # Runs before MLX is imported (its BLAS reads its own variables at load), before any
    # settings exist.
    "runtime/blas.py": "MLXCEL_BLAS, MLXCEL_BLAS_THREADS",
    # A child process learns its parent's pid from its launcher (process supervision).
    "process/loop.py": "MLXCEL_PARENT_PID",
    # A tensor-parallel follower's own command line (a process entry point).
    "tp/follower.py": "MLXCEL_LOG_LEVEL, MLXCEL_LOG_FORMAT",
}


def test_no_environment_reads_below_the_config_layer() -> None:
    found: dict[str, list[str]] = {}
    for path in PKG.rglob("*.py"):
        rel = str(path.relative_to(PKG))
        if rel.startswith(CONFIG_LAYER) or rel in CONTRACTS:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if READ.search(line):
                found.setdefault(rel, []).append(f"{n}: {line.strip()}")
    assert found == {}


def test_each_listed_contract_still_reads_what_it_names() -> None:
    for rel, names in CONTRACTS.items():
        text = (PKG / rel).read_text()
        for name in names.split(", "):
            assert name in text, (rel, name)

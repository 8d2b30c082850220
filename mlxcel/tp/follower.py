"""A tensor-parallel rank other than 0: replay rank 0's batch steps until told to stop.

``python -m mlxcel.tp.follower --model DIR --rank N --hostfile F``. It holds its shard of the
weights and a batch generator configured like rank 0's; every step it receives a
:class:`~mlxcel.messages.TpStep`, applies the same joins and leaves, and runs the same batched
forward (whose collectives need every rank). It exits 0 on a stop step and non-zero if the
group breaks.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from loguru import logger

import mlxcel  # noqa: F401  (BLAS before mlx)
from mlxcel.defaults import MAX_BATCH_SIZE, PREFILL_STEP_SIZE, STARTUP_TIMEOUT


def run_follower(
    model: Path,
    rank: int,
    hostfile: Path,
    max_batch_size: int = MAX_BATCH_SIZE,
    prefill_step_size: int = PREFILL_STEP_SIZE,
    startup_timeout: float = STARTUP_TIMEOUT,
    backend: str = "auto",
    allow_cleartext: bool = False,
    key: bytes | None = None,
) -> int:
    """Join the group as ``rank`` and replay steps until the stop step (0) or a failure (1).
    ``key``: the launch's step key (:mod:`mlxcel.tp.step_seal`); rank 0 puts it in the
    environment of the ranks it starts."""
    from mlx_lm.generate import BatchGenerator

    from mlxcel.errors import StepForged
    from mlxcel.runtime.sampling import guarded_sampler, logits_processors
    from mlxcel.tp.group import (
        broadcast_step,
        cleartext_hosts,
        init_group,
        load_sharded,
        read_hostfile,
    )
    from mlxcel.tp.step_seal import StepSeal, key_from_env

    warning = cleartext_hosts(read_hostfile(hostfile), allow_cleartext)  # refused: raises
    if warning:
        logger.warning("{}", warning)
    key = key or key_from_env()
    if key is None:  # started by hand without the secret (rank 0 gives the ranks it starts one)
        from mlxcel.errors import ConfigError
        from mlxcel.tp.launch import HOSTFILE_NEEDS_SECRET

        raise ConfigError("--tp-hostfile", HOSTFILE_NEEDS_SECRET)
    seal = StepSeal(key)
    try:
        group = init_group(rank, hostfile, startup_timeout, backend)
        loaded = load_sharded(model, group)
        gen = BatchGenerator(
            loaded.model,
            stop_tokens=[[t] for t in sorted(loaded.eos_token_ids())],
            completion_batch_size=max_batch_size,
            prefill_batch_size=max_batch_size,
            prefill_step_size=prefill_step_size,
        )
        logger.info("tp rank {} of {} ready", rank, group.size())
        while True:
            step = broadcast_step(group, None, seal)
            if step.stop:
                return 0
            if step.removals:
                gen.remove(list(step.removals))
            if step.inserts:
                gen.insert(
                    [list(i.token_ids) for i in step.inserts],
                    max_tokens=[i.sampling.max_tokens for i in step.inserts],
                    samplers=[guarded_sampler(i.sampling, {}, i.request_id) for i in step.inserts],
                    # The same processors as rank 0, or the ranks' next inputs would differ.
                    logits_processors=[logits_processors(i.sampling) for i in step.inserts],
                )
            gen.next()
    except StepForged as exc:
        logger.error("tp rank {}: {}; leaving the group", rank, exc)
        return 1
    except RuntimeError as exc:
        logger.error("tp rank {}: group failed: {}", rank, exc)
        return 1


def main() -> int:
    ap = argparse.ArgumentParser(prog="mlxcel.tp.follower")
    ap.add_argument("--model", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--hostfile", required=True)
    ap.add_argument("--max-batch-size", type=int, default=MAX_BATCH_SIZE)
    ap.add_argument("--prefill-step-size", type=int, default=PREFILL_STEP_SIZE)
    ap.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT)
    # A rank started by hand on another host may still name it in its environment.
    ap.add_argument("--tp-backend", default=os.environ.get("MLXCEL_TP_BACKEND", "auto"))
    ap.add_argument("--tp-allow-cleartext", action="store_true")
    # Rank 0's own settings, which its environment carries (see cli.main).
    ap.add_argument("--log-level", default=os.environ.get("MLXCEL_LOG_LEVEL", "INFO").upper())
    ap.add_argument("--log-format", default=os.environ.get("MLXCEL_LOG_FORMAT", "text"))
    a = ap.parse_args()
    from mlxcel.logs import setup_logging
    from mlxcel.runtime.blas import ensure_blas

    setup_logging(a.log_level, a.log_format)
    logger.info("BLAS: {}", ensure_blas())
    return run_follower(
        Path(a.model),
        a.rank,
        Path(a.hostfile),
        a.max_batch_size,
        a.prefill_step_size,
        a.startup_timeout,
        a.tp_backend,
        a.tp_allow_cleartext,
    )


if __name__ == "__main__":
    from mlxcel.loop import die_with_parent

    die_with_parent()
    sys.exit(main())

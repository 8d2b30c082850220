"""A tensor-parallel rank other than 0: replay rank 0's batch steps until told to stop.

``python -m mlxcel.tp.follower --model DIR --rank N --rendezvous HOST:PORT``, started by rank
0 (ranks started by hand come through ``generate``/``serve --tp-hostfile --tp-rank N``). It
first meets rank 0 (:mod:`.rendezvous`), then holds its shard of the weights and a batch
generator configured like rank 0's; every step it receives a
:class:`~mlxcel.base.messages.TpStep`, applies the same joins and leaves, and runs the same batched
forward (whose collectives need every rank). It exits 0 on a stop step and non-zero if the
group breaks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from loguru import logger

import mlxcel  # noqa: F401  (BLAS before mlx)
from mlxcel.base.defaults import MAX_BATCH_SIZE, PREFILL_STEP_SIZE, STARTUP_TIMEOUT
from mlxcel.base.messages import TpJoin
from mlxcel.tp.rendezvous import Meeting


def join_message(model: Path, rank: int, ring: str, hostfile: str = "") -> TpJoin:
    """What this rank tells rank 0 (``hostfile``: the digest of the one it was started
    with; "" when rank 0 started it)."""
    from mlxcel import __version__
    from mlxcel.tp.roll_call import model_digest

    return TpJoin(rank, ring, model_digest(model), hostfile, __version__)


def run_follower(
    model: Path,
    rank: int,
    meeting: Meeting,
    max_batch_size: int = MAX_BATCH_SIZE,
    prefill_step_size: int = PREFILL_STEP_SIZE,
) -> int:
    """Form the group rank 0 described (``meeting``, :mod:`.rendezvous`) and replay steps
    until the stop step (0) or a failure (1)."""
    from mlx_lm.generate import BatchGenerator

    from mlxcel.base.errors import StepForged, TpGroupFailed
    from mlxcel.runtime.prompt_cache import PromptCache
    from mlxcel.runtime.sampling import guarded_sampler, logits_processors
    from mlxcel.tp.group import agree, broadcast_step, init_group, load_sharded
    from mlxcel.tp.rendezvous import RING_BOUND
    from mlxcel.tp.step_seal import StepSeal

    seal = StepSeal(meeting.step_key)
    try:
        group = init_group(rank, meeting.ring, meeting.backend, RING_BOUND, meeting.step_key)
        loaded = load_sharded(model, group)
        eos = loaded.eos_token_ids()
        gen = BatchGenerator(
            loaded.model,
            stop_tokens=[[t] for t in sorted(eos)],
            completion_batch_size=max_batch_size,
            prefill_batch_size=max_batch_size,
            prefill_step_size=prefill_step_size,
        )
        # This rank's shard of rank 0's prompt-cache entries: the same budget and the same
        # sequences finishing in the same steps make the same entries; rank 0 decides which
        # one a sequence starts from, and ``agree`` catches any rank that cannot follow.
        budget = meeting.prompt_cache_bytes
        kept = PromptCache(budget) if budget > 0 else None
        namespace: dict[int, str] = {}
        logger.info("tp rank {} of {} ready", rank, group.size())
        while True:
            step = broadcast_step(group, None, seal)
            if step.stop:
                return 0
            # Rank 0's order: its cache is looked up before the step's leaves are kept.
            starts = _starts(kept, step.inserts, group, agree) if step.inserts else []
            if step.removals:
                if kept is not None:  # rank 0 keeps what a cancelled sequence computed
                    decoding = [u for u in step.removals if u in gen._generation_batch.uids]
                    for uid, (cache, toks) in gen.extract_cache(decoding).items():
                        kept.store(list(toks), cache, namespace.get(uid, ""))
                for uid in step.removals:
                    namespace.pop(uid, None)
                gen.remove(list(step.removals))
            if step.inserts:
                uids = gen.insert(
                    [list(i.token_ids[n:]) for i, (_, n) in zip(step.inserts, starts, strict=True)],
                    max_tokens=[i.sampling.max_tokens for i in step.inserts],
                    caches=[c for c, _ in starts],
                    all_tokens=[
                        list(i.token_ids[:n])
                        for i, (_, n) in zip(step.inserts, starts, strict=True)
                    ],
                    samplers=[guarded_sampler(i.sampling, {}, i.request_id) for i in step.inserts],
                    # The same processors as rank 0, or the ranks' next inputs would differ.
                    logits_processors=[
                        logits_processors(i.sampling, eos, loaded.tokenizer) for i in step.inserts
                    ],
                )
                for uid, i in zip(uids, step.inserts, strict=True):
                    namespace[uid] = i.cache_ns
            _, responses = gen.next()
            for r in responses:
                if r.finish_reason is not None:
                    ns = namespace.pop(r.uid, "")
                    if kept is not None:
                        kept.store(r.all_tokens, r.prompt_cache, ns)
    except (StepForged, TpGroupFailed) as exc:
        logger.error("tp rank {}: {}; leaving the group", rank, exc)
        return 1
    except RuntimeError as exc:
        logger.error("tp rank {}: group failed: {}", rank, exc)
        return 1


def _starts(kept: Any, inserts: Any, group: Any, agree: Any) -> list[tuple[Any, int]]:
    """Each inserted sequence's starting cache and the prompt tokens it covers, as rank 0
    chose: this rank's own copy of the same entry; where any rank lacks it, no cache on
    every rank (the sequence prefills in full)."""
    starts: list[tuple[Any, int]] = []
    for i in inserts:
        cache = kept.fetch_exactly(i.token_ids, i.cache_ns, i.cached) if i.cached and kept else None
        starts.append((cache, i.cached))
    cached = [k for k, i in enumerate(inserts) if i.cached]
    if cached:  # rank 0 asks exactly when a step starts any sequence from its cache
        for k, ok in zip(
            cached, agree(group, [starts[k][0] is not None for k in cached]), strict=True
        ):
            if not ok:
                if starts[k][0] is None:
                    logger.warning("tp: this rank lacks the cached prefix rank 0 chose for {}",
                                   inserts[k].request_id)  # fmt: skip
                starts[k] = (None, 0)
    return starts


def main() -> int:
    ap = argparse.ArgumentParser(prog="mlxcel.tp.follower")
    ap.add_argument("--model", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--rendezvous", required=True, help="rank 0's HOST:PORT")
    ap.add_argument("--max-batch-size", type=int, default=MAX_BATCH_SIZE)
    ap.add_argument("--prefill-step-size", type=int, default=PREFILL_STEP_SIZE)
    ap.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT)
    # Rank 0's own settings, which its environment carries (see cli.main).
    ap.add_argument("--log-level", default=os.environ.get("MLXCEL_LOG_LEVEL", "INFO").upper())
    ap.add_argument("--log-format", default=os.environ.get("MLXCEL_LOG_FORMAT", "text"))
    a = ap.parse_args()
    from mlxcel.base.errors import TpGroupFailed
    from mlxcel.net.network import free_port, split_hostport
    from mlxcel.process.logs import setup_logging
    from mlxcel.runtime.blas import ensure_blas
    from mlxcel.tp.rendezvous import attend, ring_address, secret_from_env

    setup_logging(a.log_level, a.log_format)
    secret = secret_from_env()
    if secret is None:
        logger.error("mlxcel.tp.follower is started by rank 0, which gives it a launch secret")
        return 2
    logger.info("BLAS: {}", ensure_blas())
    host, _ = split_hostport(a.rendezvous)  # rank 0 started it on its own host
    join = join_message(Path(a.model), a.rank, ring_address(host, free_port(host)))
    try:
        meeting = asyncio.run(attend(secret, a.rendezvous, join, a.startup_timeout))
    except TpGroupFailed as exc:
        logger.error("tp rank {}: {}", a.rank, exc)
        return 1
    return run_follower(Path(a.model), a.rank, meeting, a.max_batch_size, a.prefill_step_size)


if __name__ == "__main__":
    from mlxcel.process.loop import die_with_parent

    die_with_parent()
    sys.exit(main())

"""What a stage computes: its layer range over mlx-lm, one compute job at a time.

Every MLX object of a stage -- caches, input arrays, samplers -- is created and used here,
on the stage's compute thread: MLX streams belong to the thread that made them (on GPUs, and
on CPUs for any op), so the reactor and the protocol core only ever hold plain bytes and
ints. The core (:mod:`mlxcel.pipeline.stage_core`) names sequences by key; this keeps their
caches under that key until the core frees it.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from mlxcel.base.messages import DeviceTensor, ErrorCode, Tensor, join_rows, take_rows
from mlxcel.pipeline.stage_protocol import (
    ComputeJob,
    Row,
    Sampled,
    SeqKey,
    Step,
    StepFailed,
    StepOutput,
)
from mlxcel.pipeline.stage_sampling import SamplingExtras
from mlxcel.pipeline.stage_warmup import warm_up as stage_warm_up
from mlxcel.runtime.kv_usage import figures as kv_figures
from mlxcel.runtime.model import LayerRange, cache_arrays, extract_row, merge_rows
from mlxcel.runtime.prefix_store import PrefixStore
from mlxcel.runtime.sampling import Sampler, make_sampler
from mlxcel.runtime.tensors import dtype_name, from_tensor, row_tensors, to_tensor

SPANS_KEPT = 1024  # job timestamps a stage keeps for its timeline
# Start the entry stage's next step early only for this many rows or fewer. Measured on one
# H200 (8B bf16, 2026-12-03): one row 140.5 tok/s with it, 78.1 without; 32 rows 499.7 with
# it, 559.8 without -- there the device is busy anyway, and building the next step in front
# of reading the tokens delays every stream.
AHEAD_MAX_ROWS = 8


@dataclass
class MicroBatch:
    """A persistent batch (a micro-batch, or a chunk of one): a row per sequence. One row keeps
    the sequence's own caches (a KVCache per layer: no masks, the one-process decode path);
    two or more rows share a batch cache (a BatchKVCache per layer, left-padded)."""

    keys: list[SeqKey]
    cache: list[Any]


@dataclass
class StageTiming:
    """Where a stage's compute thread spent its jobs, in seconds: building the graph (Python
    and kernel launches), waiting for the device to evaluate it, and copying results to the
    host (activations to bytes, sampled tokens to ints)."""

    jobs: int = 0
    build_s: float = 0.0
    eval_s: float = 0.0
    copy_s: float = 0.0
    # The last jobs' (start, end) perf_counter readings: a timeline of when the stage computed.
    spans: collections.deque[tuple[float, float]] = field(
        default_factory=lambda: collections.deque(maxlen=SPANS_KEPT)
    )

    def add(self, t0: float, t1: float | None = None, t2: float | None = None) -> None:
        """A job's parts from its ``perf_counter`` readings: started at ``t0``, built by
        ``t1``, evaluated by ``t2``, copied by now (a reading left out: that part ended now)."""
        now = time.perf_counter()
        t1 = now if t1 is None else t1
        t2 = now if t2 is None else t2
        self.build_s += t1 - t0
        self.eval_s += t2 - t1
        self.copy_s += now - t2

    def fields(self) -> dict[str, int]:
        """As a State message carries them: microseconds, and jobs."""
        return {
            "build_us": int(self.build_s * 1e6),
            "eval_us": int(self.eval_s * 1e6),
            "copy_us": int(self.copy_s * 1e6),
            "jobs": self.jobs,
        }


@dataclass
class Ahead:
    """An entry stage's decode step started before it was asked for (see
    :meth:`StageRuntime.start_ahead`): its batch, rows, their positions, the lazy tokens it was
    built on and its submitted output."""

    bid: int
    keys: tuple[SeqKey, ...]  # the batch's rows, in order
    starts: tuple[int, ...]  # each row's position
    tokens: mx.array
    hidden: mx.array


class StageRuntime:
    """A layer range plus the per-sequence caches and samplers. Call only on one thread.

    A sequence's cache lives on its own while its prompt is filled, then -- from its first
    decode step -- as a row of a persistent batch: its micro-batch's, or, for a micro-batch
    larger than the stage's batch, its chunk's. A decode step of N sequences is one forward
    pass with no per-step merging or splitting of caches; rows join and leave only when
    membership changes.

    With ``device_handoff`` (the next stage is in this process and runs its jobs on the same
    compute thread) an activation is not evaluated here: the job submits it and returns a
    :class:`~mlxcel.base.messages.DeviceTensor`, and the next stage builds its graph on it while the
    device computes it. Otherwise a step is evaluated once and copied to the host once.

    ``ahead_to`` (the last stage of an in-process pipeline, pointing at the entry stage's
    runtime) starts the next decode step on the entry stage while this step's tokens are still
    being sampled, as mlx-lm's loop does; the entry stage uses it when the coordinator asks
    for exactly that step, and undoes it otherwise (see :meth:`start_ahead`).
    """

    def __init__(
        self, layers: LayerRange, device_handoff: bool = False, prompt_cache_bytes: int = 0
    ) -> None:
        self.layers = layers
        self.width = layers.in_width or layers.loaded.hidden_size
        self.vocab = layers.loaded.vocab_size
        self.device_handoff = device_handoff
        self.caches: dict[SeqKey, list[Any]] = {}  # sequences outside any micro-batch
        self.batches: dict[int, MicroBatch] = {}  # by an id of the runtime's own
        self.batch_of: dict[SeqKey, int] = {}
        self.regroups = 0  # rows moved into or out of a batch
        self._next_id = 0
        self.samplers: dict[SeqKey, Sampler | None] = {}
        self.extras = SamplingExtras(
            layers.loaded.eos_token_ids(), layers.loaded.tokenizer
        )  # logits processors and top_logprobs (final stage)
        self.timing = StageTiming()
        self.ahead_to: StageRuntime | None = None
        self._ahead: Ahead | None = None
        self._pos: dict[SeqKey, int] = {}  # positions each sequence's cache holds
        self.ahead_used = 0  # decode steps served from a step started ahead
        self.ahead_undone = 0
        # The KV of this range's layers for the prompt prefixes the coordinator indexes, and
        # why a sequence that should have started from one could not (its first step fails).
        self.prefixes = PrefixStore(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
        self._not_loaded: dict[SeqKey, str] = {}

    @property
    def started_ahead(self) -> tuple[SeqKey, ...]:
        """The rows of the decode step started ahead, not yet asked for (none: ())."""
        return () if self._ahead is None else self._ahead.keys

    def kv_figures(self, tokens: int) -> dict[str, int]:
        """The KV-cache figures a State reports for ``tokens`` held by this layer range."""
        loaded = self.layers.loaded
        return kv_figures(tokens, loaded.config, self.layers.end - self.layers.start)

    def free(self, key: SeqKey) -> None:
        if self._ahead is not None and key in self._ahead.keys:
            self._undo_ahead()
        self._pos.pop(key, None)
        self._not_loaded.pop(key, None)
        self.caches.pop(key, None)
        self.samplers.pop(key, None)
        self.extras.free(key)
        bid = self.batch_of.pop(key, None)
        if bid is not None:
            self._drop_row(bid, key)

    def run(self, job: ComputeJob) -> tuple[list[StepOutput], float]:
        """The job's outputs and how long it ran *on this thread*: timed here, not on the
        reactor, so the hand-offs to and from the thread count as protocol overhead."""
        t0 = time.perf_counter()
        if self._not_loaded and any(s.key in self._not_loaded for s in job.steps):
            outs = self._run_loaded(job)
        else:
            outs = self._run(job)
        t1 = time.perf_counter()
        self.timing.jobs += 1
        self.timing.spans.append((t0, t1))
        return outs, t1 - t0

    # --- the prompt cache's entries (the coordinator indexes them; see PrefixStore) ----------
    def load_prefix(self, key: SeqKey, owner: str, entry: int, tokens: int) -> None:
        """Start ``key``'s cache from ``owner``'s entry (its first ``tokens`` positions); if it
        cannot be had, the sequence's first step fails ``prefix_not_cached``."""
        cache, why = (None, "this stage keeps no prompt cache")
        try:
            if self.prefixes is not None:
                cache, why = self.prefixes.load(owner, entry, tokens)
        except Exception as exc:  # never a sequence on a cache that lacks its prefix
            cache, why = None, f"prompt-cache entry {entry} could not be copied: {exc}"
        if cache is None:
            self._not_loaded[key] = why
            return
        self.caches[key] = cache
        self._pos[key] = tokens

    def keep_prefix(self, key: SeqKey, owner: str, entry: int, tokens: int) -> str | None:
        """Keep ``key``'s cache as ``owner``'s entry (before its FreeCache); why not."""
        if self.prefixes is None:
            return "this stage keeps no prompt cache"
        if key in self._not_loaded:
            return "its cache was never loaded"
        return self.prefixes.keep(owner, entry, self._take_out(key), tokens)

    def drop_prefixes(self, owner: str, entries: tuple[int, ...] = ()) -> None:
        if self.prefixes is not None:
            self.prefixes.drop(owner, entries)

    def _run_loaded(self, job: ComputeJob) -> list[StepOutput]:
        """``job`` without the steps whose sequence could not start from its cached prefix:
        those fail alone (``prefix_not_cached``), the rest run as one job."""
        ok = [s for s in job.steps if s.key not in self._not_loaded]
        ran = iter(self._run(replace(job, steps=tuple(ok))) if ok else [])
        return [
            StepFailed(ErrorCode.PREFIX_NOT_CACHED, self._not_loaded[s.key])
            if s.key in self._not_loaded
            else next(ran)
            for s in job.steps
        ]

    def warm_up(self, tokens: int, first: bool, last: bool, batch: int = 1) -> None:
        """Serve throwaway sequences before serving (see :mod:`.stage_warmup`)."""
        stage_warm_up(self, tokens, first, last, batch)

    # --- persistent batches -----------------------------------------------------------------------
    def _drop_row(self, bid: int, key: SeqKey) -> None:
        batch = self.batches[bid]
        keep = [i for i, k in enumerate(batch.keys) if k != key]
        if not keep:
            del self.batches[bid]
            return
        if len(keep) == 1:  # a lone row decodes on its own caches again
            batch.cache = extract_row(batch.cache, keep[0])
        else:
            rows = mx.array(keep)
            for c in batch.cache:
                c.filter(rows)
        batch.keys = [batch.keys[i] for i in keep]

    def _take_out(self, key: SeqKey) -> list[Any]:
        """``key``'s own caches, out of the batch it was in (if any)."""
        if self._ahead is not None and key in self._ahead.keys:
            self._undo_ahead()
        bid = self.batch_of.pop(key, None)
        if bid is not None:
            batch = self.batches[bid]
            if len(batch.keys) == 1:
                self.caches[key] = batch.cache
                del self.batches[bid]
            else:
                self.caches[key] = extract_row(batch.cache, batch.keys.index(key))
                self._drop_row(bid, key)
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = self.layers.make_cache()
        return cache

    def _batch_for(self, keys: list[SeqKey]) -> MicroBatch:
        """A persistent batch with exactly the rows ``keys``: the one most of them are in
        already, rows taken out and added where membership changed (counted in ``regroups``);
        in steady state, as it is."""
        ids = [self.batch_of[k] for k in keys if k in self.batch_of]
        bid = max(sorted(set(ids)), key=ids.count) if ids else None
        batch = self.batches[bid] if bid is not None else None
        want = set(keys)
        for k in [k for k in batch.keys if k not in want] if batch is not None else []:
            self._take_out(k)  # not in this step: it keeps its cache, outside the batch
            self.regroups += 1
        joining = [k for k in keys if bid is None or self.batch_of.get(k) != bid]
        if not joining:
            assert batch is not None
            return batch
        own = []
        for k in joining:
            own.append(self._take_out(k))
            del self.caches[k]
        self.regroups += len(joining)
        if batch is None or bid is None:
            self._next_id += 1
            bid = self._next_id
            cache = own[0] if len(own) == 1 else merge_rows(own)
            batch = self.batches[bid] = MicroBatch(list(joining), cache)
        elif len(batch.keys) == 1:  # a lone row becomes a batch
            batch.cache = merge_rows([batch.cache, *own])
            batch.keys += joining
        else:
            for c, more in zip(batch.cache, merge_rows(own), strict=True):
                c.extend(more)
            batch.keys += joining
        for k in joining:
            self.batch_of[k] = bid
        return batch

    # --- one job ------------------------------------------------------------------------------
    def _run(self, job: ComputeJob) -> list[StepOutput]:
        """A prompt chunk runs on its sequence's own cache; decode steps (one micro-batch) run
        as one batch on the micro-batch's persistent cache, inputs in its row order."""
        t0 = time.perf_counter()
        steps, timing = job.steps, self.timing
        head = "none" if not any(s.sample for s in steps) else "all"
        if job.last and not job.return_logits and head != "none":
            head = "last"  # sampling needs the last position's logits only
        ahead = self._ahead
        if ahead is not None and job.first and any(s.key in ahead.keys for s in steps):
            hit = self._take_ahead(steps)
            if hit is not None:
                timing.add(t0)
                return hit
        for s in steps:
            self._pos[s.key] = s.start_pos + s.n
        if all(s.decode for s in steps):
            batch = self._batch_for([s.key for s in steps])
            where = {k: i for i, k in enumerate(batch.keys)}
            rows = [where[s.key] for s in steps]
            by_row = sorted(range(len(steps)), key=rows.__getitem__)
            cache = batch.cache
            x = _inputs([steps[j] for j in by_row])
        else:
            (step,) = steps  # prompt chunks run one at a time
            cache, rows, x = self._take_out(step.key), [0], _inputs([step])
        h = self.layers(x, cache, head=head)
        if not job.last:
            if self.device_handoff:
                mx.async_eval(h)  # the next stage's job, next on this thread, builds on it
                timing.add(t0)
                return [Row(_on_device(h), r) for r in rows]
            t1 = time.perf_counter()
            mx.eval(h)
            t2 = time.perf_counter()
            whole = to_tensor(h)  # one copy to the host for the whole job
            timing.add(t0, t1, t2)
            return [Row(whole, r) for r in rows]
        if head == "none":
            t1 = time.perf_counter()
            mx.eval(cache_arrays(cache))
            timing.add(t0, t1)
            return [None] * len(steps)
        if job.return_logits:
            logits = h.astype(mx.float32)
            t1 = time.perf_counter()
            mx.eval(logits)
            t2 = time.perf_counter()
            outs: list[StepOutput] = [*row_tensors(logits, rows)]
            timing.add(t0, t1, t2)
            return outs
        last = h[:, -1, :]
        if rows != sorted(rows):  # the batch's rows in step order
            last = last[mx.array(rows)]
        return self._sample(steps, last, t0)

    def _sample(self, steps: tuple[Step, ...], logits: mx.array, t0: float) -> list[StepOutput]:
        """Each row's token and its logprob, as mlx-lm's batch generator samples: the batch
        normalised at once, one argmax when every row is greedy, else each row through its
        own sampler; evaluated together. A sampler that cannot be made or called fails its
        own sequence only; an evaluation that fails fails every sampled row of the pass."""
        # Normalise in the model's dtype, like the one-process engine: in bf16 it rounds, and
        # skipping it would break near-ties differently.
        timing = self.timing
        logits = self.extras.process(steps, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers: list[Sampler | None | StepFailed] = [self._sampler(s) for s in steps]
        if all(sm is None for sm in samplers):
            toks = mx.argmax(logprobs, axis=-1)
            picks = [toks, mx.take_along_axis(logprobs, toks[:, None], axis=-1)[:, 0]]
            try:
                self._pass_ahead(steps, picks, toks)
                t1 = time.perf_counter()
                mx.eval(picks)
                t2 = time.perf_counter()
                tokens, lps = picks[0].tolist(), picks[1].tolist()
                timing.add(t0, t1, t2)
                return [
                    self._sampled(s, t, lp, logprobs[i]) if s.sample else None
                    for i, (s, t, lp) in enumerate(zip(steps, tokens, lps, strict=True))
                ]
            except Exception as exc:
                return [_failed(exc) if s.sample else None for s in steps]
        each = [
            self._pick(sm, logprobs[i : i + 1]) if s.sample else None
            for i, (s, sm) in enumerate(zip(steps, samplers, strict=True))
        ]
        t1 = time.perf_counter()
        try:
            if all(isinstance(p, tuple) for p in each):
                picked = [p for p in each if isinstance(p, tuple)]
                toks = mx.concatenate([tok.reshape(-1) for tok, _ in picked])
                self._pass_ahead(steps, [a for p in picked for a in p], toks)
            mx.eval([p for p in each if isinstance(p, tuple)])
        except Exception as exc:
            # MLX marks the arrays of a failed evaluation as evaluated and hands back garbage
            # from them: no row's token can be trusted, so every row that had one fails.
            return [_failed(exc) if isinstance(p, tuple) else p for p in each]
        t2 = time.perf_counter()
        outs = [
            self._sampled(s, int(p[0].item()), float(p[1].item()), logprobs[i])
            if isinstance(p, tuple)
            else p
            for i, (s, p) in enumerate(zip(steps, each, strict=True))
        ]
        timing.add(t0, t1, t2)
        return outs

    # --- steps started ahead (in-process pipelines) --------------------------------------------
    def _pass_ahead(self, steps: tuple[Step, ...], picks: list[mx.array], toks: mx.array) -> None:
        """Last stage: once this step's sampling is submitted, start the next decode step of the
        same sequences on the entry stage, built on the lazy ``toks`` (one per step)."""
        if self.ahead_to is None or len(steps) > AHEAD_MAX_ROWS:
            return
        if not all(s.decode and s.sample for s in steps):
            return
        # An evaluation that fails raises here (on a CPU at once): the caller fails the rows
        # as sampling failures. Their sequences are then released, caches and all, so a step
        # started ahead that broke half-way is freed with them.
        mx.async_eval(picks)
        self.ahead_to.start_ahead([s.request_id for s in steps], toks)

    def start_ahead(self, request_ids: list[str], tokens: mx.array) -> None:
        """Entry stage: if ``request_ids`` are exactly the rows of one of its persistent batches,
        run their next decode step on ``tokens`` (lazy, one per id, in that order) and submit
        it, as mlx-lm's loop builds step t+1 while step t evaluates. Only the caches of that
        batch change (one position each), undone unless the coordinator asks for that step."""
        self._undo_ahead()
        if self.layers.is_last:  # its outputs are tokens: nothing to pass on early
            return
        where = {k[0]: k for k in self.batch_of}
        keys = [where.get(r) for r in request_ids]
        bids = {self.batch_of[k] for k in keys if k is not None}
        if None in keys or len(bids) != 1 or len(set(request_ids)) != len(request_ids):
            return
        bid = bids.pop()
        batch = self.batches[bid]
        if len(batch.keys) != len(keys):
            return
        if not all(c.is_trimmable() for c in batch.cache):
            return  # recurrent state cannot be stepped back if the guess is not taken
        order = {k: i for i, k in enumerate(keys)}
        perm = [order[k] for k in batch.keys]
        if perm != list(range(len(perm))):
            tokens = tokens[mx.array(perm)]
        x = tokens.reshape(-1, 1).astype(mx.int32)
        h = self.layers(x, batch.cache, head="none")
        mx.async_eval(h)
        starts = tuple(self._pos[k] for k in batch.keys)
        self._ahead = Ahead(bid, tuple(batch.keys), starts, tokens, h)

    def _take_ahead(self, steps: tuple[Step, ...]) -> list[StepOutput] | None:
        """The outputs of the step started ahead if ``steps`` are exactly it (same rows, same
        positions, same tokens); otherwise it is undone and None returned."""
        a = self._ahead
        assert a is not None
        row = {k: i for i, k in enumerate(a.keys)}
        tokens = a.tokens.tolist()  # evaluated: the last stage has read them
        same = len(steps) == len(a.keys) and all(
            s.key in row
            and s.start_pos == a.starts[row[s.key]]
            and s.tokens == (tokens[row[s.key]],)
            for s in steps
        )
        if not same:
            self._undo_ahead()
            return None
        self._ahead = None
        self.ahead_used += 1
        for s in steps:
            self._pos[s.key] = s.start_pos + 1
        whole = _on_device(a.hidden)
        return [Row(whole, row[s.key]) for s in steps]

    def _undo_ahead(self) -> None:
        a, self._ahead = self._ahead, None
        if a is not None:
            self.ahead_undone += 1
            for c in self.batches[a.bid].cache:
                c.trim(1)

    def _sampled(self, step: Step, token: int, logprob: float, row: mx.array) -> Sampled:
        self.extras.record(step, token)
        return Sampled(token, logprob, self.extras.top(step, row))

    def _sampler(self, step: Step) -> Sampler | None | StepFailed:
        """``step``'s sequence's sampler (None: greedy), made on its first sampled step."""
        if not step.sample:
            return None
        try:
            if step.key not in self.samplers:
                self.samplers[step.key] = make_sampler(step.sampling)
            return self.samplers[step.key]
        except Exception as exc:
            return _failed(exc)

    def _pick(
        self, sampler: Sampler | None | StepFailed, logprobs: mx.array
    ) -> tuple[mx.array, mx.array] | StepFailed:
        if isinstance(sampler, StepFailed):
            return sampler
        try:
            tok = sampler(logprobs) if sampler is not None else mx.argmax(logprobs, -1)
            # The chosen token's logprob joins the same evaluation (no second round trip).
            return tok, mx.take_along_axis(logprobs, tok.reshape(1, 1), axis=-1)
        except Exception as exc:
            return _failed(exc)


def _inputs(steps: list[Step]) -> mx.array:
    """Token ids ``[B, n]`` (entry stage) or hidden states ``[B, n, width]``, in this order:
    the rows of one message's tensor, in its order, are that tensor as it is; rows of one
    shape and dtype are joined on the host (or on one device array) and cross to MLX as one
    array."""
    if steps[0].tokens is not None:
        return mx.array([list(s.tokens or ()) for s in steps], dtype=mx.int32)
    first = steps[0].hidden
    assert first is not None
    if all(s.hidden is first for s in steps):
        return _array_of(take_rows(first, [s.row for s in steps]))
    parts = [take_rows(s.hidden, [s.row]) for s in steps if s.hidden is not None]
    arrays = {id(p.array) if isinstance(p, DeviceTensor) else None for p in parts}
    if len({(p.dtype, p.shape[1:]) for p in parts}) == 1 and len(arrays) == 1:
        return _array_of(join_rows(parts))
    return mx.concatenate([_array_of(p) for p in parts], axis=0)


def _on_device(h: mx.array) -> DeviceTensor:
    """All of ``h`` as a tensor that stays on the device (an in-process hand-off)."""
    return DeviceTensor(dtype_name(h.dtype), tuple(h.shape), b"", h, tuple(range(h.shape[0])))


def _array_of(t: Tensor) -> mx.array:
    if not isinstance(t, DeviceTensor):
        return from_tensor(t)
    whole, rows = t.array, list(t.rows)
    assert isinstance(whole, mx.array)
    if rows == list(range(rows[0], rows[0] + len(rows))):  # a run of rows: a slice
        return whole if len(rows) == whole.shape[0] else whole[rows[0] : rows[0] + len(rows)]
    return whole[mx.array(rows)]


def _failed(exc: Exception) -> StepFailed:
    return StepFailed(ErrorCode.SAMPLING_FAILED, f"sampling failed: {type(exc).__name__}: {exc}")


__all__ = ["StageRuntime", "Tensor"]

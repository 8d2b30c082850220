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
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
from loguru import logger

from mlxcel.messages import DeviceTensor, ErrorCode, SamplingParams, Tensor
from mlxcel.pipeline.stage_protocol import ComputeJob, Sampled, SeqKey, Step, StepFailed, StepOutput
from mlxcel.runtime.model import LayerRange, extract_row, merge_rows
from mlxcel.runtime.sampling import Sampler, make_sampler
from mlxcel.runtime.tensors import dtype_name, from_tensor, row_tensors, to_tensor

WARM_UP_ROWS = 32  # the largest batch warm-up runs: each row is a throwaway prompt to fill
# Prompt chunks of these many tokens meet every tile class of MLX's quantized matmul on a
# GPU: it takes fewer than 8 rows as vectors and tiles 8 or more by the next power of two,
# 16 to 64 (a 21-token prompt compiled the 32-row kernel for 32 s on a fresh H200).
TILE_CLASS_ROWS = (16, 32, 64)
SPANS_KEPT = 1024  # job timestamps a stage keeps for its timeline
WARM_UP_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, seed=0)


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

    def fields(self) -> dict[str, int]:
        """As a State message carries them: microseconds, and jobs."""
        return {
            "build_us": int(self.build_s * 1e6),
            "eval_us": int(self.eval_s * 1e6),
            "copy_us": int(self.copy_s * 1e6),
            "jobs": self.jobs,
        }


class StageRuntime:
    """A layer range plus the per-sequence caches and samplers. Call only on one thread.

    A sequence's cache lives on its own while its prompt is filled, then -- from its first
    decode step -- as a row of a persistent batch: its micro-batch's, or, for a micro-batch
    larger than the stage's batch, its chunk's. A decode step of N sequences is one forward
    pass with no per-step merging or splitting of caches; rows join and leave only when
    membership changes.

    With ``device_handoff`` (the next stage is in this process and runs its jobs on the same
    compute thread) an activation is not evaluated here: the job submits it and returns a
    :class:`~mlxcel.messages.DeviceTensor`, and the next stage builds its graph on it while the
    device computes it. Otherwise a step is evaluated once and copied to the host once.
    """

    def __init__(self, layers: LayerRange, device_handoff: bool = False) -> None:
        self.layers = layers
        self.width = layers.loaded.hidden_size
        self.vocab = int(layers.loaded.config["vocab_size"])
        self.device_handoff = device_handoff
        self.caches: dict[SeqKey, list[Any]] = {}  # sequences outside any micro-batch
        self.batches: dict[int, MicroBatch] = {}  # by an id of the runtime's own
        self.batch_of: dict[SeqKey, int] = {}
        self.regroups = 0  # rows moved into or out of a batch
        self._next_id = 0
        self.samplers: dict[SeqKey, Sampler | None] = {}
        self.timing = StageTiming()

    def free(self, key: SeqKey) -> None:
        self.caches.pop(key, None)
        self.samplers.pop(key, None)
        bid = self.batch_of.pop(key, None)
        if bid is not None:
            self._drop_row(bid, key)

    def run(self, job: ComputeJob) -> tuple[list[StepOutput], float]:
        """The job's outputs and how long it ran *on this thread*: timed here, not on the
        reactor, so the hand-offs to and from the thread count as protocol overhead."""
        t0 = time.perf_counter()
        outs = self._run(job)
        t1 = time.perf_counter()
        self.timing.jobs += 1
        self.timing.spans.append((t0, t1))
        return outs, t1 - t0

    def warm_up(self, tokens: int, first: bool, last: bool, batch: int = 1) -> None:
        """Serve throwaway sequences through :meth:`run`, as the coordinator would, then free
        them: one ``tokens``-long prompt and its first decode step alone (sampled with top-p,
        top-k and min-p filters); then up to ``WARM_UP_ROWS`` short prompts whose decode steps
        run as batches of 2, 4, ... ``batch`` rows (gathered into a batch cache, regrouped as
        the size changes; greedy); and prompts of ``TILE_CLASS_ROWS`` tokens, alone.

        A GPU compiles a kernel the first time it meets a shape class (on a fresh H200, about
        30 s for each of MLX's quantized matmul kernels); this compiles the serving path's
        (prompt chunks of every tile class, batched decode with padded masks, batch caches that
        grow and shrink, batched greedy and filtered sampling) before the stage reports ready.
        MLX keeps what it compiled on disk, so a later start on the same machine is quick."""
        most = max(1, min(batch, WARM_UP_ROWS))
        sizes = sorted({1 << k for k in range(1, most.bit_length())} | {most}) if most > 1 else []
        lengths = [tokens + 1] + [3 + i % 5 for i in range(most if sizes else 0)]
        lengths += [n + 1 for n in TILE_CLASS_ROWS if n < tokens]  # prompt-only sequences
        keys = [("warm-up", -1 - i) for i in range(len(lengths))]
        groups = [keys[:1]] + [keys[1 : 1 + b] for b in sizes for _ in range(2)]

        def forwards() -> Iterator[list[Step]]:
            for key, n in zip(keys, lengths, strict=True):
                yield [self._warm_step(key, n - 1, 0, first, False)]
            pos = {key: n - 1 for key, n in zip(keys, lengths, strict=True)}
            for group in groups:
                steps = [self._warm_step(k, 1, pos[k], first, True) for k in group]
                if group[0] == keys[0]:  # the long prompt samples: filters, categorical draw
                    steps = [replace(steps[0], sampling=WARM_UP_SAMPLING)]
                yield steps
                pos.update({k: pos[k] + 1 for k in group})

        total, t0 = len(keys) + len(groups), time.monotonic()
        said = t0
        for i, steps in enumerate(forwards(), 1):
            self.run(self._warm_job(steps, first, last))
            if time.monotonic() - said > 5.0:  # compiling: say so, for whoever waits on us
                said = time.monotonic()
                logger.info("warm-up: {} of {} forwards in {:.0f}s", i, total, said - t0)
        for key in keys:
            self.free(key)
        self.regroups = 0  # counts serving only

    def _warm_step(self, key: SeqKey, n: int, start: int, first: bool, sample: bool) -> Step:
        tokens = (0,) * n if first else None
        hidden = None if first else to_tensor(mx.zeros((1, n, self.width), self.layers.dtype))
        return Step(key, 0, tokens, hidden, n, start, SamplingParams(), 0, sample)

    @staticmethod
    def _warm_job(steps: list[Step], first: bool, last: bool) -> ComputeJob:
        return ComputeJob(0, tuple(steps), first, last, False)

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
        steps = job.steps
        head = "none" if not any(s.sample for s in steps) else "all"
        if job.last and not job.return_logits and head != "none":
            head = "last"  # sampling needs the last position's logits only
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
        timing = self.timing
        if not job.last:
            if self.device_handoff:
                mx.async_eval(h)  # the next stage's job, next on this thread, builds on it
                timing.build_s += time.perf_counter() - t0
                name, shape = dtype_name(h.dtype), (1, *h.shape[1:])
                return [DeviceTensor(name, shape, b"", h, r) for r in rows]
            t1 = time.perf_counter()
            mx.eval(h)
            t2 = time.perf_counter()
            outs: list[StepOutput] = [*row_tensors(h, rows)]
            timing.build_s += t1 - t0
            timing.eval_s += t2 - t1
            timing.copy_s += time.perf_counter() - t2
            return outs
        if head == "none":
            t1 = time.perf_counter()
            mx.eval([c.state for c in cache])
            timing.build_s += t1 - t0
            timing.eval_s += time.perf_counter() - t1
            return [None] * len(steps)
        if job.return_logits:
            logits = h.astype(mx.float32)
            t1 = time.perf_counter()
            mx.eval(logits)
            t2 = time.perf_counter()
            outs = [*row_tensors(logits, rows)]
            timing.build_s += t1 - t0
            timing.eval_s += t2 - t1
            timing.copy_s += time.perf_counter() - t2
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
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers: list[Sampler | None | StepFailed] = [self._sampler(s) for s in steps]
        if all(sm is None for sm in samplers):
            toks = mx.argmax(logprobs, axis=-1)
            picks = [toks, mx.take_along_axis(logprobs, toks[:, None], axis=-1)[:, 0]]
            try:
                t1 = time.perf_counter()
                mx.eval(picks)
                t2 = time.perf_counter()
                tokens, lps = picks[0].tolist(), picks[1].tolist()
                timing.build_s += t1 - t0
                timing.eval_s += t2 - t1
                timing.copy_s += time.perf_counter() - t2
                return [
                    Sampled(t, lp) if s.sample else None
                    for s, t, lp in zip(steps, tokens, lps, strict=True)
                ]
            except Exception as exc:
                return [_failed(exc) if s.sample else None for s in steps]
        each = [
            self._pick(sm, logprobs[i : i + 1]) if s.sample else None
            for i, (s, sm) in enumerate(zip(steps, samplers, strict=True))
        ]
        t1 = time.perf_counter()
        try:
            mx.eval([p for p in each if isinstance(p, tuple)])
        except Exception as exc:
            # MLX marks the arrays of a failed evaluation as evaluated and hands back garbage
            # from them: no row's token can be trusted, so every row that had one fails.
            return [_failed(exc) if isinstance(p, tuple) else p for p in each]
        t2 = time.perf_counter()
        outs = [
            Sampled(int(p[0].item()), float(p[1].item())) if isinstance(p, tuple) else p
            for p in each
        ]
        timing.build_s += t1 - t0
        timing.eval_s += t2 - t1
        timing.copy_s += time.perf_counter() - t2
        return outs

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
    rows of one shape and dtype are joined on the host and cross to MLX as one array; device
    tensors that are the rows of one array, in its order, are that array."""
    if steps[0].tokens is not None:
        return mx.array([list(s.tokens or ()) for s in steps], dtype=mx.int32)
    hs = [s.hidden for s in steps]
    first = hs[0]
    assert first is not None
    if isinstance(first, DeviceTensor):
        whole = first.array
        assert isinstance(whole, mx.array)
        if all(isinstance(h, DeviceTensor) and h.array is whole for h in hs) and [
            h.row
            for h in hs  # type: ignore[union-attr]
        ] == list(range(whole.shape[0])):
            return whole
    if len(hs) == 1 or any(
        h is None or isinstance(h, DeviceTensor) or (h.dtype, h.shape) != (first.dtype, first.shape)
        for h in hs
    ):
        arrays = [_array_of(h) for h in hs]  # type: ignore[arg-type]
        return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=0)
    joined = b"".join(h.data for h in hs)  # type: ignore[union-attr]
    return from_tensor(Tensor(first.dtype, (len(hs) * first.shape[0], *first.shape[1:]), joined))


def _array_of(t: Tensor) -> mx.array:
    if isinstance(t, DeviceTensor):
        whole = t.array
        assert isinstance(whole, mx.array)
        return whole[t.row : t.row + 1]
    return from_tensor(t)


def _failed(exc: Exception) -> StepFailed:
    return StepFailed(ErrorCode.SAMPLING_FAILED, f"sampling failed: {type(exc).__name__}: {exc}")


__all__ = ["StageRuntime", "Tensor"]

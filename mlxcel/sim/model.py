"""A fake model for simulated stages: deterministic, cheap, and sensitive to every mistake.

Each stage keeps, per sequence, a 64-bit running hash of every position it has seen (its
"KV cache"); each position's output mixes that hash with the stage's index. The final stage's
token is the last output modulo the vocabulary. So a step run twice, skipped, run on another
sequence's cache or out of order changes every later token -- and :func:`reference` computes
the right tokens without any network, for the invariant checks.

Activations are real :class:`~mlxcel.base.messages.Tensor` messages of a configurable width (the
bytes the simulated links carry); the first 8 bytes of each row hold the position's value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxcel.base.messages import ErrorCode, Tensor, take_rows
from mlxcel.pipeline.stage_protocol import ComputeJob, Sampled, SeqKey, StepFailed, StepOutput

MASK = (1 << 64) - 1
PRIME = 0x100000001B3


def step_time(job: ComputeJob, step_s: float, per_token_s: float) -> float:
    """Virtual compute time of one job: a fixed cost per forward pass plus one per position."""
    return step_s + per_token_s * sum(s.n for s in job.steps)


def mix(h: int, x: int, salt: int) -> int:
    h = ((h ^ (x & MASK)) * PRIME + salt) & MASK
    return h ^ (h >> 29)


@dataclass(frozen=True)
class FakeModel:
    n_layers: int
    vocab: int = 512
    width: int = 64  # activation row width, in float32 elements (>= 2)
    eos: int = 0
    seed: int = 0
    step_s: float = 0.004  # compute time of one forward pass...
    per_token_s: float = 0.0002  # ...plus this per position in it

    def salt(self, stage: int) -> int:
        return (self.seed * 1_000_003 + stage * 7919 + 1) & MASK

    def compute_time(self, job: ComputeJob) -> float:
        return step_time(job, self.step_s, self.per_token_s)

    def stage(self, index: int, n_stages: int) -> FakeStage:
        return FakeStage(self, index)

    def reference(self, n_stages: int, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        return reference(self, n_stages, prompt, max_tokens)


@dataclass
class FakeStage:
    """One stage's backend: the fake caches, and what it was asked to hold and free.

    Its prompt-cache entries are a cache's running hash after each position (so an entry cut
    back to n positions is exact), kept under (owner, entry id) within ``capacity`` positions;
    ``loads`` records which entry each sequence started from, for the tenant invariant."""

    model: FakeModel
    index: int
    caches: dict[SeqKey, int] = field(default_factory=dict)
    fail_sampling: bool = False
    capacity: int = 0  # positions its prompt-cache entries may hold
    history: dict[SeqKey, list[int]] = field(default_factory=dict)
    entries: dict[tuple[str, int], tuple[list[int], str]] = field(default_factory=dict)
    loads: list[tuple[str, str]] = field(default_factory=list)  # (request, entry's creator)
    missing: set[SeqKey] = field(default_factory=set)

    def load_prefix(self, key: SeqKey, owner: str, entry: int, tokens: int) -> None:
        held = self.entries.pop((owner, entry), None)
        if held is None or len(held[0]) < tokens:
            self.missing.add(key)
            return
        self.entries[(owner, entry)] = held  # the most recently used
        self.history[key] = held[0][:tokens]
        self.caches[key] = held[0][tokens - 1]
        self.loads.append((key[0], held[1]))

    def keep_prefix(self, key: SeqKey, owner: str, entry: int, tokens: int) -> str | None:
        seen = self.history.get(key, [])
        if key in self.missing or len(seen) != tokens or tokens > self.capacity:
            return "not kept"
        self.entries.pop((owner, entry), None)
        while sum(len(h) for h, _ in self.entries.values()) + tokens > self.capacity:
            del self.entries[next(iter(self.entries))]  # room, least recently used first
        self.entries[(owner, entry)] = (list(seen), key[0])
        return None

    def drop_prefixes(self, owner: str, entries: tuple[int, ...] = ()) -> None:
        for k in [k for k in self.entries if k[0] == owner and (not entries or k[1] in entries)]:
            del self.entries[k]

    def run(self, job: ComputeJob) -> list[StepOutput]:
        salt = self.model.salt(self.index)
        outs: list[StepOutput] = []
        for step in job.steps:
            if step.key in self.missing:
                outs.append(StepFailed(ErrorCode.PREFIX_NOT_CACHED, "entry not held"))
                continue
            h = self.caches.get(step.key, 0)
            if step.tokens is not None:
                xs = list(step.tokens)
            else:
                assert step.hidden is not None
                data = take_rows(step.hidden, [step.row]).data
                row = step.hidden.shape[2] * 4
                xs = [int.from_bytes(data[i * row : i * row + 8], "little") for i in range(step.n)]
            ys = []
            for x in xs:
                h = mix(h, x, salt)
                ys.append(h)
            self.caches[step.key] = h
            self.history.setdefault(step.key, []).extend(ys)
            if not job.last:
                row = self.model.width * 4
                body = b"".join(y.to_bytes(8, "little") + bytes(row - 8) for y in ys)
                outs.append(Tensor("float32", (1, len(ys), self.model.width), body))
            elif not step.sample:
                outs.append(None)
            elif self.fail_sampling:
                outs.append(StepFailed(ErrorCode.SAMPLING_FAILED, "simulated sampler failure"))
            else:
                outs.append(Sampled(ys[-1] % self.model.vocab, 0.0))
        return outs

    def free(self, key: SeqKey) -> None:
        self.caches.pop(key, None)
        self.history.pop(key, None)
        self.missing.discard(key)


def reference(
    model: FakeModel, n_stages: int, prompt: tuple[int, ...], max_tokens: int
) -> list[int]:
    """The tokens a correct pipeline of ``n_stages`` returns for ``prompt`` (greedy)."""
    hs = [0] * n_stages
    salts = [model.salt(i) for i in range(n_stages)]

    def run(x: int) -> int:
        for i in range(n_stages):
            hs[i] = mix(hs[i], x, salts[i])
            x = hs[i]
        return x % model.vocab

    token = 0
    for x in prompt:
        token = run(x)
    out: list[int] = []
    while True:
        if token == model.eos:
            return out
        out.append(token)
        if len(out) >= max_tokens:
            return out
        token = run(token)

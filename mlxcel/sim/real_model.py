"""The real ``tiny`` checkpoint as a simulated cluster's compute, for small clusters.

Each simulated stage runs its layer range through the same :class:`StageRuntime` a real stage
process uses (mlx-lm layers, one-row ``BatchKVCache`` per sequence, batched decode), on the
simulator's thread; virtual time still advances by the configured step time. The reference is
the whole model as one range, fed exactly as the coordinator feeds a pipeline: prompt chunks
that only fill caches, then one token per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlxcel.base.messages import SamplingParams
from mlxcel.pipeline.stage_protocol import ComputeJob, Step, StepOutput
from mlxcel.pipeline.stage_runtime import StageRuntime
from mlxcel.runtime.model import LayerRange, LoadedModel, load_model, split_even
from mlxcel.sim.model import step_time


@dataclass
class RealStage:
    runtime: StageRuntime

    @property
    def caches(self) -> dict[object, object]:
        return self.runtime.caches  # type: ignore[return-value]

    def run(self, job: ComputeJob) -> list[StepOutput]:
        return self.runtime.run(job)[0]

    def free(self, key: tuple[str, int]) -> None:
        self.runtime.free(key)


@dataclass
class RealModel:
    path: Path
    prefill_step_size: int = 8
    step_s: float = 0.004
    per_token_s: float = 0.0002
    loaded: LoadedModel = field(init=False)

    def __post_init__(self) -> None:
        self.loaded = load_model(self.path)
        self.vocab = self.loaded.vocab_size
        self.width = self.loaded.hidden_size
        self.eos = min(self.loaded.eos_token_ids())
        self.n_layers = self.loaded.n_layers

    def compute_time(self, job: ComputeJob) -> float:
        return step_time(job, self.step_s, self.per_token_s)

    def stage(self, index: int, n_stages: int) -> RealStage:
        start, end = split_even(self.n_layers, n_stages)[index]
        return RealStage(StageRuntime(LayerRange(self.loaded, start, end)))

    def reference(self, n_stages: int, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        rt = StageRuntime(LayerRange(self.loaded, 0, self.n_layers))
        sp = SamplingParams(max_tokens=max_tokens)
        key = ("reference", 0)
        jobs = 0

        def step(tokens: tuple[int, ...], pos: int, sample: bool) -> StepOutput:
            nonlocal jobs
            jobs += 1
            s = Step(key, 0, tokens, None, len(tokens), pos, sp, jobs, sample)
            return rt.run(ComputeJob(jobs, (s,), True, True, False))[0][0]

        prefix, pos = prompt[:-1], 0
        while prefix:
            piece, prefix = prefix[: self.prefill_step_size], prefix[self.prefill_step_size :]
            step(piece, pos, False)
            pos += len(piece)
        out: list[int] = []
        token_in = prompt[-1:]
        while True:
            sampled = step(token_in, pos, True)
            pos += 1
            token = sampled.token  # type: ignore[union-attr]
            if token in self.loaded.eos_token_ids():
                return out
            out.append(token)
            if len(out) >= max_tokens:
                return out
            token_in = (token,)


_REAL: dict[Path, RealModel] = {}


def real_model(path: Path) -> RealModel:
    """The real checkpoint at ``path``, loaded once per process."""
    if path not in _REAL:
        _REAL[path] = RealModel(path)
    return _REAL[path]

"""Splitting a model's layers into contiguous pipeline stages.

Costs come from the checkpoint itself: the byte size of every tensor, read from the
safetensors headers (no weights are loaded). A decoder layer costs the bytes of its tensors;
the embedding is charged to the first stage and the final norm and LM head to the last (a tied
head re-uses the embedding, so the last stage is charged for it too). Uneven models -- a
dense layer 0, cheap attention-only layers, heavy expert layers -- therefore split correctly
without per-family tables. Without declared memory the split balances time: the bytes a
stage multiplies by, so the embedding (a table lookup) does not count, while a tied head (a
full matmul over the embedding) does -- a byte-balanced split of a small model with a large
vocabulary leaves the last stage the bottleneck. With declared per-node memory the split
balances bytes/memory and refuses a plan that does not fit, showing the numbers.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from mlxcel.base.errors import PartitionError
from mlxcel.base.model_config import active_fraction, decoder_config

# The decoder's prefix in multimodal-shaped checkpoints (Qwen 3.5, Kimi K3): mlx-lm saves
# ``language_model.model.``, Hugging Face ships ``model.language_model.``.
_DECODER = re.compile(
    r"^(?:language_model\.model\.|model\.language_model\.|language_model\.|model\.)"
)
# A decoder layer's tensors (after that prefix): ``layers.N.``.
_LAYER = re.compile(r"^layers\.(\d+)\.")
# What mlx-lm drops when it loads a checkpoint: multi-token-prediction heads, and the vision
# tower of a multimodal one.
_DROPPED = re.compile(r"^(?:model\.|language_model\.)?(?:mtp[._]|visual\.|vision_tower\.)")
# Routed experts, stacked (mlx-lm's SwitchGLU: ``switch_mlp``; gpt-oss: ``mlp.experts``) or
# one tensor per expert (``experts.7.``); shared experts are dense and always run.
_EXPERT = re.compile(r"\.(?:switch_mlp|experts)\.")


@dataclass(frozen=True)
class LayerCosts:
    layers: tuple[int, ...]  # bytes held per decoder layer
    embed: int
    head: int  # final norm + LM head (+ the embedding again when tied)
    other: int  # anything else (charged to the first stage)
    # Bytes each layer multiplies by per token: its bytes, less the routed experts a token
    # does not visit (an MoE layer of 128 experts, 8 per token, computes with 1/16 of them).
    active: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.layers) + self.embed + self.head + self.other

    @property
    def compute(self) -> tuple[int, ...]:
        return self.active or self.layers


@dataclass(frozen=True)
class StagePlan:
    index: int
    start: int  # first layer
    end: int  # one past the last layer
    bytes: int
    share: float
    memory: float | None = None  # declared bytes, when known

    @property
    def spec(self) -> str:
        return f"{self.start}-{self.end - 1}"


def read_safetensors_sizes(model_dir: Path) -> dict[str, int]:
    """Tensor name -> byte size, from the headers of every *.safetensors file."""
    sizes: dict[str, int] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise PartitionError(f"{model_dir}: no *.safetensors files to size the layers from")
    for f in files:
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise PartitionError(f"{f}: not a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > 100 << 20:
                raise PartitionError(f"{f}: implausible header size {n}")
            try:
                header = json.loads(fh.read(n))
            except ValueError as exc:
                raise PartitionError(f"{f}: bad safetensors header: {exc}") from None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            sizes[name] = int(end) - int(start)
    return sizes


def layer_costs(
    model_dir: Path, n_layers: int | None = None, tied: bool | None = None
) -> LayerCosts:
    model_dir = Path(model_dir)
    config = decoder_config(json.loads((model_dir / "config.json").read_text()))
    n = n_layers if n_layers is not None else int(config["num_hidden_layers"])
    tie = bool(config.get("tie_word_embeddings", False)) if tied is None else tied
    share = active_fraction(config)
    per_layer = [0] * n
    active = [0] * n
    embed = head = other = 0
    for name, size in read_safetensors_sizes(model_dir).items():
        if _DROPPED.match(name):
            continue
        bare = _DECODER.sub("", name, count=1)
        m = _LAYER.match(bare)
        if m:
            i = int(m.group(1))
            if i < n:  # layers past the count (a multi-token-prediction layer) never load
                per_layer[i] += size
                active[i] += round(size * share) if _EXPERT.search(name) else size
            continue
        if "embed_tokens" in name:
            embed += size
        elif bare.startswith(("lm_head", "norm")):
            head += size
        else:
            other += size
    if tie:
        head += embed
    return LayerCosts(tuple(per_layer), embed, head, other, tuple(active))


def parse_layers(spec: str, n_layers: int, source: str = "--pp-layers") -> list[tuple[int, int]]:
    """``"0-15,16-31"`` (inclusive ranges) -> ``[(0, 16), (16, 32)]``, fully validated;
    ``source`` names where the ranges came from in an error."""
    ranges: list[tuple[int, int]] = []
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)-(\d+)", part)
        if not m:
            raise PartitionError(f"{source}: bad range {part!r} (expected START-END, e.g. 0-15)")
        a, b = int(m.group(1)), int(m.group(2))
        if b < a:
            raise PartitionError(f"{source}: range {part!r} is empty (end before start)")
        ranges.append((a, b + 1))
    expected = 0
    for a, b in ranges:
        if a != expected:
            raise PartitionError(
                f"{source}: range {a}-{b - 1} should start at layer {expected} "
                "(ranges must be contiguous, in order, from layer 0)"
            )
        expected = b
    if expected != n_layers:
        raise PartitionError(
            f"{source}: ranges cover layers 0-{expected - 1} but the model has {n_layers} (0-{n_layers - 1})"
        )
    return ranges


def _stage_cost(costs: LayerCosts, start: int, end: int, n_stages_last: bool, first: bool) -> int:
    c = sum(costs.layers[start:end])
    if first:
        c += costs.embed + costs.other
    if n_stages_last:
        c += costs.head
    return c


def plan(
    costs: LayerCosts, ranges: list[tuple[int, int]], memory: list[float] | None = None
) -> list[StagePlan]:
    total = costs.total or 1
    out = []
    for i, (a, b) in enumerate(ranges):
        c = _stage_cost(costs, a, b, i == len(ranges) - 1, i == 0)
        out.append(StagePlan(i, a, b, c, c / total, memory[i] if memory else None))
    if memory:
        over = [s for s in out if s.memory is not None and s.bytes > s.memory]
        if over:
            raise PartitionError("plan does not fit the declared memory:\n" + format_plan(out))
    return out


def auto_split(
    costs: LayerCosts, n_stages: int, memory: list[float] | None = None
) -> list[StagePlan]:
    """Contiguous split minimising the largest stage cost (time, or bytes/memory when
    ``memory`` is declared), by dynamic programming."""
    n = len(costs.layers)
    if not 1 <= n_stages <= n:
        raise PartitionError(f"cannot split {n} layers into {n_stages} stages")
    if memory is not None and len(memory) != n_stages:
        raise PartitionError(f"{len(memory)} memory figures for {n_stages} stages")
    weight = memory or [1.0] * n_stages
    # With memory declared the split balances what each node holds; without, the time each
    # stage computes (an MoE layer's routed experts count for the share a token visits).
    per_layer = costs.layers if memory is not None else costs.compute
    prefix = [0]
    for c in per_layer:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][j]: minimal bottleneck placing layers [0, j) on stages [0, s)
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        last = s == n_stages
        for j in range(s, n + 1):
            if last and j != n:
                continue
            for i in range(s - 1, j):
                if best[s - 1][i] == inf:
                    continue
                c = prefix[j] - prefix[i]
                if s == 1:
                    c += costs.other + (costs.embed if memory is not None else 0)
                if last:
                    c += costs.head
                v = max(best[s - 1][i], c / weight[s - 1])
                if v < best[s][j]:
                    best[s][j] = v
                    cut[s][j] = i
    ranges = []
    j = n
    for s in range(n_stages, 0, -1):
        i = cut[s][j]
        ranges.append((i, j))
        j = i
    ranges.reverse()
    return plan(costs, ranges, memory)


def human_bytes(n: float) -> str:
    """``n`` bytes as an operator reads them: 500 B, 2.0 KiB, 15.3 GiB."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def format_plan(stages: list[StagePlan]) -> str:
    rows = [f"{'stage':>5}  {'layers':>9}  {'bytes':>14}  {'share':>6}  {'memory':>14}"]
    for s in stages:
        mem = f"{s.memory:>14,.0f}" if s.memory is not None else f"{'-':>14}"
        flag = "  <- does not fit" if s.memory is not None and s.bytes > s.memory else ""
        rows.append(f"{s.index:>5}  {s.spec:>9}  {s.bytes:>14,}  {s.share:>6.1%}  {mem}{flag}")
    return "\n".join(rows)

"""The stages a checkpoint splits into, planned from its files before any weight loads.

Its config.json says whether a layer-range executor runs the family and how many layers
there are; its safetensors headers say what each layer holds (:mod:`.partition` prices and
places them). Reading files only, never MLX: a coordinator plans with this and runs no layer.
"""

from __future__ import annotations

from pathlib import Path

from mlxcel.base.errors import PartitionError
from mlxcel.pipeline.partition import StagePlan, auto_split, layer_costs, parse_layers, plan
from mlxcel.runtime.families import check_splittable, layer_count

# What names the stage count and the ranges in an error: the flags, or the cluster TOML's keys.
FLAG_SOURCES = ("--pp-size", "--pp-layers")
CLUSTER_SOURCES = ("the cluster's pipeline_parallel_size", "the cluster's stage layers")


def make_plan(
    model_path: Path,
    pp_size: int,
    pp_layers: str | None,
    memory: list[float] | None = None,
    *,
    sources: tuple[str, str] = FLAG_SOURCES,
) -> list[StagePlan]:
    """The stages of a split of the checkpoint at ``model_path``, from its config.json and
    safetensors headers alone: an unsupported family, a bad range or a stage count the layers
    cannot take is refused before any weight loads. ``sources`` names the stage count and the
    ranges in errors (flags, or the cluster TOML's keys)."""
    n_layers = layer_count(check_splittable(model_path))
    costs = layer_costs(model_path, n_layers)
    if pp_layers:
        return plan(costs, parse_layers(pp_layers, n_layers, sources[1]), memory)
    try:
        return auto_split(costs, pp_size, memory)
    except PartitionError as exc:
        raise PartitionError(f"{sources[0]} {pp_size}: {exc}") from None

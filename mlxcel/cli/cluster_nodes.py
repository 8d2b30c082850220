"""The node a cluster TOML names, and the secret every distributed node requires: shared by
``--distributed-config`` and the bring-up paths of ``serve``."""

from __future__ import annotations

import os
from pathlib import Path

from loguru import logger

from mlxcel.config.settings import ServeSettings, router_stats_verbose
from mlxcel.net.secret import ClusterSecret, load_cluster_secret
from mlxcel.pipeline.cluster_config import ClusterConfig, NodeSpec
from mlxcel.serving.assembly import CoordinatorSpec, StackSpec, StageSpec


def cluster_node_spec(
    s: ServeSettings, cfg: ClusterConfig, me: NodeSpec, path: Path, secret: ClusterSecret
) -> StackSpec:
    """The stage or the coordinator ``me`` of ``cfg`` (written by hand or by a bring-up)."""
    if s.peer_timeout is not None:  # the flag (or MLXCEL_PEER_TIMEOUT) wins over the TOML
        cluster = cfg.cluster.model_copy(update={"peer_timeout": s.peer_timeout})
        cfg = cfg.model_copy(update={"cluster": cluster})
    if me.role == "stage":
        return StageSpec(
            cfg, me, path, secret, s.pp_return_logits, s.cluster_interface, s.trust_weights,
            warm_up=s.warmup,
        )  # fmt: skip
    return CoordinatorSpec(
        cfg,
        me,
        path,
        secret,
        s.pp_return_logits,
        s.cluster_interface,
        s.trust_weights,
        s.startup_timeout,
        s.pp_micro_batch_size,
        router_stats_verbose,
    )


def cluster_secret(settings: ServeSettings, toml_path: Path | None) -> ClusterSecret:
    """Every process of a distributed config authenticates its peers: fail closed."""
    secret = load_cluster_secret(
        settings.cluster_secret_file,
        os.environ,  # MLXCEL_CLUSTER_SECRET(_FILE): read here, at the surface
        toml_path,
        required=True,
        cli_label=settings.origin("cluster_secret_file"),
    )
    assert secret is not None
    logger.info("cluster secret from {}", secret.source)
    return secret

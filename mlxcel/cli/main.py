"""``python -m mlxcel`` / ``mlxcel`` / ``mlxcel-server``: the entry points.

It configures logging and starts the loop through :mod:`mlxcel.process.loop` (the one place that
picks uvloop and handles signals); everything below runs on whatever loop it is given.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from loguru import logger

from mlxcel import __version__
from mlxcel.base.errors import ConfigError, MlxcelError, PartitionError, PlatformUnsupported
from mlxcel.config.cli import (
    OneLineParser,
    add_arguments,
    die,
    load_settings,
    unknown_arguments,
)
from mlxcel.config.settings import GenerateSettings, ServeSettings
from mlxcel.config.tools import (
    BenchBatchingSettings,
    BenchBringupSettings,
    BenchDisaggSettings,
    BenchEngineSettings,
    BenchFaultsSettings,
    BenchFloodsSettings,
    BenchFramesSettings,
    BenchHostileSettings,
    BenchPipelineRunSettings,
    BenchPromptCacheSettings,
    BenchTpSettings,
    CheckpointSettings,
    ClusterCheckSettings,
    DemoSettings,
    KeygenSettings,
    SimSettings,
    StatusSettings,
)
from mlxcel.process.logs import setup_logging
from mlxcel.process.loop import run_async
from mlxcel.process.platform_guard import DISTRIBUTED_FLAGS, refuse_distributed_on_windows

COMMANDS: dict[str, tuple[type, str]] = {
    "demo": (DemoSettings, "start a loopback 2-stage cluster, stream a chat completion, shut down"),
    "generate": (GenerateSettings, "generate text from a prompt and print timing"),
    "serve": (ServeSettings, "run the OpenAI-compatible HTTP server"),
    "checkpoint": (CheckpointSettings, "write a deterministic random-weight checkpoint"),
    "cluster-check": (
        ClusterCheckSettings,
        "check the cluster handshake between two hosts (secret, address, interface)",
    ),
    "keygen": (KeygenSettings, "write a new random cluster secret (32 bytes, hex, mode 0600)"),
    "status": (StatusSettings, "a table of the cluster behind a serving node (--watch: live)"),
    "sim": (SimSettings, "simulate pipeline clusters with seeded faults on a virtual clock"),
}
BENCHES: dict[str, tuple[type, str]] = {
    "engine": (
        BenchEngineSettings,
        "decode tok/s and TTFT: mlxcel's engine beside mlx-lm's own path, same prompts",
    ),
    "prompt-cache": (
        BenchPromptCacheSettings,
        "TTFT of a chat's 2nd turn: history from the prompt cache vs prefilled, beside mlx-lm",
    ),
    "batching": (BenchBatchingSettings, "aggregate decode tok/s at several concurrent streams"),
    "frames": (BenchFramesSettings, "frame protection latency and bandwidth over loopback"),
    "tp": (BenchTpSettings, "decode tok/s at tensor-parallel sizes 1 and 2"),
    "pipeline": (
        BenchPipelineRunSettings,
        "decode tok/s: one process vs 2 stages in-process vs 2 stage processes, beside mlx-lm",
    ),
    "disagg": (
        BenchDisaggSettings,
        "TTFT and inter-token latency p50/p99: one hybrid node vs 1 prefill + 1 decode",
    ),
    "faults": (
        BenchFaultsSettings,
        "silent/stopped decode, prefill and stage on network namespaces: detect, 503, recover",
    ),
    "floods": (
        BenchFloodsSettings,
        "discovery under a beacon flood, first dials under a pending-pool flood (namespaces)",
    ),
    "hostile": (
        BenchHostileSettings,
        "huge prompts, HTTP floods from several addresses, a slow handoff link, a faulty member",
    ),
    "bringup": (
        BenchBringupSettings,
        "seconds from a --pp-auto coordinator's start to its first token, 2 loopback peers",
    ),
}


# Every command's table name in a TOML file, with its settings (load_settings checks all).
SECTIONS: dict[str, type] = {
    **{name: cls for name, (cls, _) in COMMANDS.items()},
    **{f"bench.{name}": cls for name, (cls, _) in BENCHES.items()},
}


def _enable_stack_dumps() -> None:
    """``kill -USR1 <pid>`` prints every thread's stack to stderr (for a stuck process)."""
    if sys.platform != "win32":
        import faulthandler
        import signal

        faulthandler.register(signal.SIGUSR1, all_threads=True)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="mlxcel", description="Distributed LLM inference on MLX.")
    parser.add_argument("--version", action="version", version=f"mlxcel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, (cls, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p, cls)
    bench = sub.add_parser("bench", help="benchmarks that print figures", description="benchmarks")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", parser_class=OneLineParser)
    for name, (cls, help_text) in BENCHES.items():
        p = bsub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p, cls)
    return parser


def _guard(command: str, args: argparse.Namespace) -> None:
    # Raw values, before validation and before any model is resolved.
    raw = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    for field in {f for _flag, f, _asks in DISTRIBUTED_FLAGS.get(command, [])}:
        env = os.environ.get(f"MLXCEL_{field.upper()}")
        if field not in raw and env is not None:
            raw[field] = env
    refuse_distributed_on_windows(command, raw)


def _status_url(argv: list[str]) -> list[str]:
    """`status URL [--watch]` as one would type it: the one bare argument is the URL."""
    if not argv or argv[0] != "status":
        return argv
    valued = {"--url", "--interval", "--api-key", "--config", "--log-level", "--log-format"}
    for i in range(1, len(argv)):
        if not argv[i].startswith("-") and argv[i - 1] not in valued:
            return [*argv[:i], "--url", *argv[i:]]
    return argv


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    argv = _status_url(list(sys.argv[1:] if argv is None else argv))
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            raise ConfigError(parser.prog, unknown_arguments(parser, args, unknown))
        if args.command is None:
            parser.print_help()
            raise SystemExit(2)
        if args.command in ("generate", "serve"):
            _guard(args.command, args)
        if args.command == "bench":
            if args.bench is None:
                raise ConfigError("bench", "name a benchmark: " + ", ".join(BENCHES))
            cls = BENCHES[args.bench][0]
            section = f"bench.{args.bench}"
        else:
            cls = COMMANDS[args.command][0]
            section = args.command
        settings = load_settings(
            cls,
            args,
            section=section,
            sections=SECTIONS,
        )
        if args.command in ("generate", "serve"):
            # Again on the final values: a --config / MLXCEL_CONFIG file may ask for a mode.
            refuse_distributed_on_windows(args.command, settings.model_dump())
        if hasattr(settings, "tp_size"):
            from mlxcel.tp.group import check_modes

            check_modes(settings.tp_moe_mode, settings.tp_embedding_mode, settings.tp_lm_head_mode)
            pipelined = (
                getattr(settings, "pp_size", 1) > 1
                or getattr(settings, "pp_layers", None) is not None
            )
            if (settings.tp_size > 1 or settings.tp_hostfile) and (
                pipelined or getattr(settings, "distributed_config", None)
            ):
                raise ConfigError(
                    "--tp-size", "tensor and pipeline parallelism cannot be combined yet"
                )
    except (ConfigError, PlatformUnsupported) as exc:
        die(exc, argv)
    setup_logging(settings.log_level, settings.log_format)
    # Processes this one starts (stages, ranks, nodes) log in the same format.
    os.environ["MLXCEL_LOG_FORMAT"] = settings.log_format
    for note in settings.notes:
        logger.info("note: {}", note)
    _enable_stack_dumps()
    if args.command not in ("keygen", "cluster-check", "status"):
        from mlxcel.runtime.blas import blas_problem, ensure_blas

        logger.info("BLAS: {}", ensure_blas())  # every process that computes says which
        if (problem := blas_problem()) is not None:
            logger.warning("BLAS: {}", problem)  # shown at the benchmarks' WARNING level too
    try:
        code = _dispatch(args, settings)
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        # The reader left (`mlxcel status URL | head -1`): what it wanted was printed. Point
        # stdout at nothing so the exit's flush does not raise again, and end quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    except (ConfigError, PartitionError) as exc:
        logger.error("{}", exc)  # logging is up: the one format, like every other line
        code = 2
    except MlxcelError as exc:
        logger.error("{}", exc)
        code = 1
        if type(exc).__name__ == "TpGroupFailed" or getattr(exc, "code", None) == "tp_group_failed":
            # A broken tensor-parallel group can leave a thread blocked in a collective that
            # never returns; joining it at exit would hang. Leave now, with the error shown.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    raise SystemExit(code)


def server_main() -> None:
    """``mlxcel-server``: the same as ``mlxcel serve``."""
    main(["serve", *sys.argv[1:]])


def _dispatch(args: argparse.Namespace, settings: Any) -> int:
    from mlxcel.cli import commands

    if args.command == "checkpoint":
        return commands.checkpoint(settings)
    if args.command == "keygen":
        return commands.keygen(settings)
    if args.command == "status":
        from mlxcel.cli.status import status

        return status(settings)
    if args.command == "sim":
        from mlxcel.cli.sim import run_sim

        return run_sim(settings)
    if args.command == "cluster-check":
        from mlxcel.cli.cluster_check import run_check

        return run_async(run_check(settings))
    if args.command == "demo":
        return run_async(commands.demo(settings))
    if args.command == "bench" and args.bench == "pipeline":
        from mlxcel.bench.pipeline import run_bench

        return run_async(
            run_bench(
                commands.resolve_model(settings.model, settings.shape, settings.family),
                settings.tokens,
                settings.json_lines,
                streams=[int(x) for x in settings.streams.split(",") if x.strip()],
                micro_batch_size=settings.pp_micro_batch_size,
                reference=settings.reference,
                pin=settings.pin,
                netns_rate=settings.netns_rate,
                protection_cost=settings.protection_cost,
            )
        )
    if args.command == "bench" and args.bench == "engine":
        from mlxcel.bench.engine import run_bench as run_engine_bench

        return run_async(
            run_engine_bench(
                commands.resolve_model(settings.model, settings.shape, settings.family),
                [int(x) for x in settings.streams.split(",") if x.strip()],
                settings.prompt_tokens,
                settings.tokens,
                settings.json_lines,
                repeats=settings.repeats,
            )
        )
    if args.command == "bench" and args.bench == "prompt-cache":
        from mlxcel.bench.prompt_cache import run_bench as run_cache_bench

        path = commands.resolve_model(settings.model, settings.shape, settings.family)
        return run_async(run_cache_bench(path, settings))
    if args.command == "bench" and args.bench == "tp":
        from mlxcel.bench.tp import run_bench as run_tp_bench

        return run_async(
            run_tp_bench(
                commands.resolve_model(settings.model, settings.shape, settings.family),
                settings.tokens,
                settings.json_lines,
                streams=settings.streams,
            )
        )
    if args.command == "bench" and args.bench == "bringup":
        from mlxcel.bench.bringup import run_bench as run_bringup_bench

        return run_bringup_bench(commands.resolve_model(settings.model), settings.json_lines)
    if args.command == "bench" and args.bench == "faults":
        from mlxcel.bench.faults import run_bench as run_faults_bench

        return run_faults_bench(commands.resolve_model(settings.model), settings.json_lines)
    if args.command == "bench" and args.bench == "floods":
        from mlxcel.bench.floods import run_bench as run_floods_bench

        return run_floods_bench(commands.resolve_model(settings.model), settings.json_lines)
    if args.command == "bench" and args.bench == "hostile":
        from mlxcel.bench.hostile import run_bench as run_hostile_bench

        return run_hostile_bench(commands.resolve_model(settings.model), settings.json_lines)
    if args.command == "bench" and args.bench == "disagg":
        from mlxcel.bench.disagg import run_bench as run_disagg_bench

        return run_async(
            run_disagg_bench(
                commands.resolve_model(settings.model, settings.shape),
                streams=settings.streams,
                tokens=settings.tokens,
                long_prompts=settings.long_prompts,
                long_len=settings.long_len,
                json_lines=settings.json_lines,
            )
        )
    if args.command == "bench" and args.bench == "frames":
        return run_async(commands.bench_frames(settings))
    if args.command == "bench":
        return run_async(commands.bench_batching(settings))
    if args.command == "generate":
        return run_async(commands.generate(settings))
    if args.command == "serve":
        from mlxcel.cli.serving import serve

        return run_async(serve(settings))
    raise AssertionError(args.command)  # pragma: no cover

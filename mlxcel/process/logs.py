"""One log format for everything a process prints about itself.

mlxcel's own lines, the standard ``logging`` records of the libraries under it (aiohttp,
huggingface_hub, transformers, asyncio) and Python warnings all go through one loguru sink on
stderr: ``HH:MM:SS.mmm LEVEL   message`` lines, or with ``--log-format json`` one JSON object
per line (time, level, message, logger, pid, and any bound extras) for log shippers.

A command's own output (generated text, benchmark rows, reports) is not logging: it goes to
stdout as data.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from typing import Any

from loguru import logger

TEXT_FORMAT = "{time:HH:mm:ss.SSS} {level: <7} {message}"


class _ToLoguru(logging.Handler):
    """Forward a standard-library record to loguru at its level, naming its logger."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        msg = record.getMessage()
        if record.name == "aiohttp.server" and record.exc_info:
            # A malformed request (a header too long, a bad request line): aiohttp answers
            # 400 itself. Its traceback would echo the client's bytes: one line instead.
            exc = record.exc_info[1]
            logger.debug("aiohttp.server: bad HTTP request: {}", type(exc).__name__)
            return
        if record.exc_info:
            msg += "\n" + logging.Formatter().formatException(record.exc_info)
        logger.opt(depth=0).bind(logger_name=record.name).log(level, "{}: {}", record.name, msg)


def adopt_library_logging() -> None:
    """transformers prints through its own stderr handler (``[transformers] …``), which it
    installs on import: hand its records to the root logger (and so to loguru) instead. Call
    after anything that may have imported it (mlx-lm's loaders)."""
    tl = sys.modules.get("transformers.utils.logging")
    if tl is not None:
        tl.disable_default_handler()
        tl.enable_propagation()


def _json_sink(message: Any) -> None:
    r = message.record
    out = {
        "time": r["time"].isoformat(timespec="milliseconds"),
        "level": r["level"].name,
        "message": r["message"],
        "logger": r["extra"].get("logger_name", r["name"]),
        "pid": r["process"].id,
    }
    out.update({k: v for k, v in r["extra"].items() if k != "logger_name"})
    if r["exception"] is not None:
        import traceback

        exc = r["exception"]
        out["exception"] = "".join(traceback.format_exception(exc.type, exc.value, exc.traceback))
    sys.stderr.write(json.dumps(out, default=str) + "\n")
    sys.stderr.flush()


def _showwarning(message: Any, category: type, filename: str, lineno: int, *_: Any) -> None:
    logger.warning("{}: {} ({}:{})", category.__name__, message, filename, lineno)


FORMAT = "text"  # what setup_logging chose: progress bars are for text logs only


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    global FORMAT
    FORMAT = fmt
    logger.remove()
    # diagnose=False: tracebacks never print variable values, which could hold secrets or
    # payload bytes (rules of the house: neither reaches a log line).
    if fmt == "json":
        logger.add(_json_sink, level=level, diagnose=False, backtrace=False)
    else:
        logger.add(sys.stderr, level=level, format=TEXT_FORMAT, diagnose=False, backtrace=False)
    root = logging.getLogger()
    root.handlers = [_ToLoguru()]
    # Libraries log at their own levels; loguru's sink applies ours. Below WARNING they
    # only speak when asked (DEBUG/TRACE), as their own defaults do.
    root.setLevel(logging.DEBUG if level in ("TRACE", "DEBUG") else logging.WARNING)
    logging.getLogger("aiohttp.access").disabled = True  # mlxcel writes its own access line
    warnings.showwarning = _showwarning

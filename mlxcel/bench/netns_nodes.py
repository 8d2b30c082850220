"""Processes and clients on namespace hosts (:mod:`mlxcel.bench.netns`): what the fault
benchmark and its tests run and send.

:class:`NodeProc` starts ``python -m mlxcel serve`` inside a host and reads its log until it
says it is ready; :class:`Client` sends HTTP from inside a host (its threads enter the host's
network namespace); :class:`Load` keeps a steady trickle of requests going and keeps every
:class:`Outcome`.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from mlxcel.bench.netns import Hosts
from mlxcel.reactor.faults import Fault

CLONE_NEWNET = 0x40000000
HTTP_PORT = 8080
CLUSTER_PORT = 7000
READY_WAIT = 180.0


def enter_netns(name: str) -> None:
    """Move the calling *thread* into network namespace ``name`` (its sockets live there)."""
    _setns(f"/var/run/netns/{name}", name)


@contextmanager
def in_netns(name: str) -> Iterator[None]:
    """The calling thread in namespace ``name`` for the block, then back where it was."""
    home = f"/proc/{os.getpid()}/task/{threading.get_native_id()}/ns/net"
    keep = os.open(home, os.O_RDONLY)  # held open: the namespace to come back to
    try:
        enter_netns(name)
        try:
            yield
        finally:
            _setns(f"/proc/self/fd/{keep}", f"back from {name}")
    finally:
        os.close(keep)


def _setns(path: str, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({what}): {os.strerror(err)}")
    finally:
        os.close(fd)


class NodeProc:
    """One ``python -m mlxcel serve`` inside a host, started and read until it says ready."""

    def __init__(self, hosts: Hosts, i: int, args: list[str], ready: str) -> None:
        argv = [sys.executable, "-m", "mlxcel", "serve", *args]
        self.p = hosts.spawn(i, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        assert self.p.stdout is not None
        end = time.monotonic() + READY_WAIT
        while time.monotonic() < end:
            line = self.p.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if ready in line:
                threading.Thread(target=self._drain, daemon=True).start()
                return
        self.stop()
        raise RuntimeError(f"node on host {i} did not start:\n" + "".join(self.lines[-30:]))

    def _drain(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line)

    def signal(self, sig: int) -> None:
        # ``ip netns exec`` execs the command: the pid is the server's own.
        self.p.send_signal(sig)

    def stopped(self, name: str) -> Fault:
        """The process stopped (SIGSTOP: silent, its sockets open), then continued."""
        return Fault(
            name, partial(self.signal, signal.SIGSTOP), partial(self.signal, signal.SIGCONT)
        )

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGCONT)
            self.p.terminate()
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)


@dataclass
class Outcome:
    sent: float
    done: float
    status: int  # HTTP status; 0: no answer (timeout or connection error)
    retry_after: bool = False
    body: str = ""  # an error's body (what the client was told)


@dataclass
class Client:
    """HTTP from inside host ``host`` (a thread pool whose threads entered its namespace)."""

    hosts: Hosts
    host: int
    base: str
    pool: ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        name = self.hosts.names[self.host]
        # Requests and polls on separate threads: hanging requests must not delay a poll.
        self.pool = ThreadPoolExecutor(128, initializer=enter_netns, initargs=(name,))
        self._polls = ThreadPoolExecutor(4, initializer=enter_netns, initargs=(name,))

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, dict[str, Any]]:
        return self._polls.submit(_get, self.base + path, timeout).result()

    def complete(self, max_tokens: int = 4, timeout: float = 60.0) -> Outcome:
        return self.pool.submit(_complete, self.base, max_tokens, timeout).result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self._polls.shutdown(wait=True, cancel_futures=True)


def _get(url: str, timeout: float) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except (OSError, ValueError):
        return 0, {}


def _complete(base: str, max_tokens: int, timeout: float) -> Outcome:
    body = json.dumps(
        {"model": "m", "prompt": "fault bench", "max_tokens": max_tokens, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        base + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    sent = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return Outcome(sent, time.monotonic(), r.status)
    except urllib.error.HTTPError as exc:
        text = exc.read()[:2000].decode(errors="replace")
        retry = exc.headers.get("Retry-After") is not None
        return Outcome(sent, time.monotonic(), exc.code, retry, text)
    except OSError:
        return Outcome(sent, time.monotonic(), 0)


class Load:
    """A request every ``every`` seconds, each on its own thread; outcomes kept in order."""

    def __init__(self, client: Client, every: float = 0.1, max_tokens: int = 4) -> None:
        self.client, self.every, self.max_tokens = client, every, max_tokens
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        futures = []
        while not self._stop.wait(self.every):
            futures.append(
                self.client.pool.submit(_complete, self.client.base, self.max_tokens, 60)
            )
        for f in futures:
            self.outcomes.append(f.result())


def wait_for(check: Callable[[], bool], timeout: float, step: float = 0.05) -> float | None:
    """Seconds until ``check()`` held (None: it did not within ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def keygen(path: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "mlxcel", "keygen", "--out", str(path)],
        check=True,
        capture_output=True,
    )
    return path

"""Run one node inside any asyncio loop: setup, start, stop (aiohttp's ``AppRunner`` is the
model).

Every mode's :class:`~mlxcel.serving.stack.Stack` (see the registry in :mod:`mlxcel.serving.assembly`) hands
the runner its :class:`~mlxcel.serving.stack.Serving`: its node, what it serves over HTTP (if
anything), its cluster listener (if any) and how it drains. The runner owns the
*sites*: it binds them in ``start()`` and resolves ``started`` with their addresses, or with
the bind error at once, so an embedding service learns about a port in use immediately.
``stop()`` drains in-flight requests, then closes the sites. The runner installs no signal
handlers: the CLI does that (``mlxcel.cli.serving``); an embedding service stops the runner
its own way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from loguru import logger

from mlxcel.base.errors import ListenError
from mlxcel.serving.stack import Serving, Stack

# Seconds the handlers of requests ended at the drain's end get to write their final error
# (and aiohttp, to close the connections) before the sites close anyway.
END_GRACE = 2.0


@dataclass
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    model_name: str = "mlxcel"
    default_max_tokens: int = 512
    max_body_bytes: int = 4 << 20
    header_timeout: float = 10.0  # seconds to send a request's headers (slow-loris)
    body_timeout: float = 30.0  # seconds to send its body once the headers are in
    max_connections: int | None = None  # open HTTP connections (None: below the fd limit)
    api_key: str | None = None  # every request but /health/live needs it (Bearer)
    api_keys: tuple[str, ...] = ()  # or any of these (with api_key): each its own tenant
    shared_prompt_cache: bool = False  # every key shares one prompt cache
    allowed_origins: tuple[str, ...] = ()  # CORS: origins, or ("*",); () sends no CORS header
    # Sampling for a request that gives none: "temperature", "top_p", "min_p" (serve's --temp,
    # --top-p, --min-p); what is missing here is OpenAI's default.
    sampling_defaults: dict[str, float] = field(default_factory=dict)


class NodeRunner:
    def __init__(
        self,
        stack: Stack[Any] | Serving,
        http: HttpOptions | None = None,
        *,
        drain_timeout: float = 30.0,
    ) -> None:
        serving = stack.serving if isinstance(stack, Stack) else stack
        self.serving = serving
        self.http = http if serving.frontend is not None else None
        self.drain_timeout = drain_timeout
        self.started: asyncio.Future[dict[str, str]] = asyncio.get_running_loop().create_future()
        self.addresses: dict[str, str] = {}
        self._stop = asyncio.Event()
        self._serving = False
        self._app_runner: web.AppRunner | None = None
        self.guard: Any = None  # the HttpGuard in front of the HTTP site

    async def setup(self) -> None:
        """Build the HTTP application (nothing is bound yet). A failure here also resolves
        ``started``, so whoever waits on it learns at once."""
        try:
            await self._setup()
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        if not self.started.done():
            self.started.set_exception(exc)
            self.started.exception()  # retrieved: the caller also gets it raised

    async def _setup(self) -> None:
        if self.http is None:
            return
        from mlxcel.server.http_guard import HttpGuard

        self.guard = HttpGuard(
            max_connections=self.http.max_connections, header_timeout=self.http.header_timeout
        )
        app = openai_app(self.serving, self.http, self.guard)
        self._app_runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=END_GRACE
        )
        await self._app_runner.setup()

    async def start(self) -> dict[str, str]:
        """Bind every site; ``started`` (and the return value) name what is listening."""
        try:
            if self.serving.listener is not None:
                await self.serving.listener.start()
                self.addresses["cluster"] = self.serving.listener.address
            if self._app_runner is not None and self.http is not None:
                from mlxcel.server.http_guard import GuardedSite

                assert self.guard is not None
                site = GuardedSite(self._app_runner, self.http.host, self.http.port, self.guard)
                try:
                    await site.start()
                except OSError as exc:
                    raise ListenError(
                        f"cannot serve HTTP on {self.http.host}:{self.http.port}: "
                        f"{exc.strerror or exc}"
                    ) from None
                bound = self._app_runner.addresses
                port = bound[0][1] if bound else self.http.port
                self.addresses["http"] = f"http://{self.http.host}:{port}"
        except BaseException as exc:
            self._fail(exc)
            await self._close_sites()
            raise
        self._serving = True
        self.started.set_result(dict(self.addresses))
        return dict(self.addresses)

    def request_stop(self) -> None:
        """Ask the runner to stop (what the CLI's SIGINT/SIGTERM handler calls)."""
        self._stop.set()

    async def wait(self) -> None:
        """Until ``request_stop()``, the stack saying it is done, or the stack closing."""
        events = (self._stop, self.serving.done, self.serving.closed)
        waits = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def stop(self) -> None:
        """Drain in-flight requests (up to ``drain_timeout``), then close every site. A runner
        that never started serving has nothing to drain (the frontend may be another's)."""
        if not self._serving:
            await self._close_sites()
            return
        self._serving = False
        fe = self.serving.frontend
        if fe is not None:
            logger.info("draining: admitting no new requests, finishing {} in flight", fe.in_flight)
            loop = asyncio.get_running_loop()
            await fe.drain(loop.time() + self.drain_timeout)
            if fe.in_flight or fe.waiting:
                ended = fe.end_all()
                logger.warning(
                    "drain timeout ({:g} s): ending {} request(s) still running with "
                    "server_shutting_down",
                    self.drain_timeout,
                    ended,
                )
                # Their handlers write the final error and return: a moment, not a drain.
                await fe.drain(loop.time() + END_GRACE)
        elif self.serving.drain is not None:
            logger.info("draining: taking no new work, finishing what is in flight")
            left = await self.serving.drain(asyncio.get_running_loop().time() + self.drain_timeout)
            if left:
                logger.warning(
                    "drain timeout ({:g} s): closing with {} sequence(s) still in flight (their "
                    "requests end with an error where they came from)",
                    self.drain_timeout,
                    left,
                )
        logger.info("shutting down")
        await self._close_sites()

    async def _close_sites(self) -> None:
        if self._app_runner is not None:
            runner, self._app_runner = self._app_runner, None
            await runner.cleanup()
        if "cluster" in self.addresses and self.serving.listener is not None:
            await self.serving.listener.close()  # stops accepting and closes its connections


def openai_app(
    stack: Stack[Any] | Serving, http: HttpOptions | None = None, guard: Any = None
) -> web.Application:
    """The HTTP API of a serving stack as an aiohttp application, bound to nothing: what
    :class:`NodeRunner` serves, for a service that mounts it in its own application
    (``app.add_subapp("/llm", openai_app(stack))``) and runs its own sites. ``guard``: the
    runner's connection guard (its middleware runs first)."""
    from mlxcel.server.metrics import Metrics
    from mlxcel.server.openai_api import build_app

    serving = stack.serving if isinstance(stack, Stack) else stack
    http = http or HttpOptions()
    fe, node = serving.frontend, serving.node
    if fe is None:
        raise ValueError(f"a {serving.label} node serves no HTTP API (it has no frontend)")
    metrics = Metrics()
    metrics.bind(
        queue_depth=lambda: fe.waiting,
        inflight=serving.inflight,
        inflight_requests=lambda: fe.in_flight,
        handler_errors=lambda: sum(node.bus.handler_errors.values()),
    )
    if serving.prompt_cache is not None:
        metrics.bind_prompt_cache(serving.prompt_cache)
    app = build_app(
        fe,
        metrics,
        model_name=http.model_name,
        default_max_tokens=http.default_max_tokens,
        max_body_bytes=http.max_body_bytes,
        health_extra=serving.health,
        sampling=serving.sampling,
        mode=serving.label,
        guard=guard,
        body_timeout=http.body_timeout,
        api_keys=(*((http.api_key,) if http.api_key else ()), *http.api_keys),
        shared_prompt_cache=http.shared_prompt_cache,
        allowed_origins=http.allowed_origins,
        sampling_defaults=http.sampling_defaults,
    )
    for path, answer in serving.extra_get.items():
        app.router.add_get(path, _json_route(answer))
    add_cluster_routes(app, _cluster_view(serving, http.model_name, metrics))
    add_text_routes(app, has_dashboard=True)
    return app


def _cluster_view(serving: Serving, model_name: str, metrics: Any) -> Any:
    from mlxcel.base.topology import single_topology
    from mlxcel.server.cluster_view import ClusterView, ttft_p50_ms

    fe = serving.frontend
    assert fe is not None

    async def alone() -> Any:
        return single_topology(serving.label, fe.in_flight, serving.kv and serving.kv())

    def totals() -> dict[str, Any]:
        return {
            "generated_tokens": metrics.generated_total,
            "prompt_tokens": metrics.prompt_total,
            "requests": metrics.requests_done,
            "running": fe.in_flight,
            "waiting": fe.waiting,
            "ttft_ms_p50": ttft_p50_ms(list(metrics.recent_ttft)),
        }

    view = ClusterView(model_name, serving.label, serving.topology or alone, totals)
    metrics.bind_cluster(lambda: view.last, model_name)
    metrics.refresh = view.snapshot
    return view


def add_text_routes(app: web.Application, *, has_dashboard: bool) -> None:
    """/tokenize, /detokenize, /version and / (:mod:`mlxcel.server.text_routes`)."""
    from mlxcel.server.text_routes import add_text_routes as add

    add(app, has_dashboard=has_dashboard)


def add_cluster_routes(app: web.Application, view: Any) -> None:
    """GET /cluster (the view as JSON) and /dashboard (the page that draws it)."""
    from mlxcel.server.dashboard import PAGE

    async def cluster(_request: web.Request) -> web.Response:
        return web.json_response(await view.snapshot())

    async def dashboard(_request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html", charset="utf-8")

    app.router.add_get("/cluster", cluster)
    app.router.add_get("/dashboard", dashboard)


def _json_route(answer: Callable[[], Any]) -> Callable[[web.Request], Any]:
    async def handler(_request: web.Request) -> web.Response:
        return web.json_response(answer())

    return handler

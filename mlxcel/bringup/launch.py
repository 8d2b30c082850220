"""Run a bring-up for real: ``serve --pp-auto N`` (push) and ``serve --pp-peer`` (wait).

Both end in an ordinary cluster: the coordinator returns the plan it pushed (and wrote), the
peer the cluster it received (and wrote); the CLI then serves them exactly as it serves a
hand-written ``--distributed-config`` -- the same stage and coordinator code, on the same
addresses. The assignment runs on its own authenticated channel (``assignment``: its own
keys), on a node that is closed before the stage or the coordinator starts.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import secrets
import socket
import tomllib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from mlxcel import __version__
from mlxcel.base.errors import AssignmentRefused, BringupFailed, ConfigError, MlxcelError
from mlxcel.bringup.beacon import BEACON_PORT, BeaconGate, beacon_key, looks_like_beacon
from mlxcel.bringup.identity import model_identity
from mlxcel.bringup.peer_core import PeerCore, PeerFacts
from mlxcel.bringup.plan import BringupPlan, derived_range, peer_file
from mlxcel.bringup.protocol import FRAME_BOUND, HANDSHAKE_BOUND, ModelIdentity
from mlxcel.bringup.push_core import PushConfig, PushCore
from mlxcel.bringup.service import PeerService, PushService, beacon_announcer
from mlxcel.net.listener import ClusterListener, Limits
from mlxcel.net.network import ReplyEndpoint, TcpEndpoint, split_hostport
from mlxcel.net.pool import Backoff, ConnectionPool
from mlxcel.net.secret import ClusterSecret
from mlxcel.net.udp import BeaconReceiver, BeaconSender
from mlxcel.pipeline.cluster_config import ClusterConfig, parse_cluster_toml
from mlxcel.pipeline.partition import LayerCosts, human_bytes, layer_costs
from mlxcel.reactor.bus import Node
from mlxcel.wire.handshake import Channel, Identity

CONTROL_PORT = 19000  # the coordinator's control port when --cluster-control-addr is not given
# The peer's assignment listener: a small pending pool (it expects one coordinator).
PEER_LIMITS = Limits(
    max_connections=16,
    max_pending=8,
    max_pending_per_source=4,
    handshake_timeout=HANDSHAKE_BOUND,
    frame_timeout=FRAME_BOUND,
    # The assignment protocol bounds every phase itself, and a peer loading its stage on
    # Activate may be too busy for keepalives: no liveness deadline on this channel.
    peer_timeout=None,
)


@dataclass(frozen=True)
class Discovery:
    mode: str = "static"  # or "mdns"
    peers: tuple[str, ...] = ()
    target: str = "255.255.255.255"
    port: int = BEACON_PORT


def route_ip(towards: str) -> str:
    """The local IP the OS would use to reach ``towards`` (a broadcast address included; no
    packet is sent). Raises ConfigError when there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        try:
            s.connect((towards, 9))
            return str(s.getsockname()[0])
        except OSError as exc:
            raise ConfigError(
                "--cluster-control-addr",
                f"cannot tell which local address reaches {towards} ({exc.strerror}); "
                "give the coordinator's control address explicitly",
            ) from None


def check_local(address: str) -> None:
    """The control address must be this host's: the coordinator dials from it and stages
    connect to it. Refused at start rather than as a 50 s "did not accept" later."""
    host, _ = split_hostport(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError as exc:
            raise ConfigError(
                "--cluster-control-addr",
                f"{address}: {host} is not an address of this host ({exc.strerror})",
            ) from None


def control_address(explicit: str | None, http_host: str, discovery: Discovery) -> str:
    """--cluster-control-addr, else the --host IP on port 19000 (an unspecified --host: the
    address this host reaches the first peer, or the beacon target, from)."""
    if explicit:
        host, port = split_hostport(explicit)
        if ipaddress.ip_address(host).is_unspecified:
            raise ConfigError(
                "--cluster-control-addr",
                f"{explicit}: the coordinator's control address must be an IP the peers can reach "
                "(stages reply to it), not an unspecified one",
            )
        return explicit
    try:
        unspecified = ipaddress.ip_address(http_host).is_unspecified
    except ValueError:
        raise ConfigError("--host", f"{http_host!r} is not an IP address") from None
    if not unspecified:
        return Identity(http_host, CONTROL_PORT).address
    towards = discovery.peers[0].rpartition(":")[0] if discovery.peers else discovery.target
    return f"{route_ip(towards.strip('[]'))}:{CONTROL_PORT}"


async def _model_facts(path: Path, trust_weights: bool) -> tuple[ModelIdentity, LayerCosts]:
    # A family no stage can run is refused here, from config.json, before anything is hashed,
    # offered or loaded.
    from mlxcel.runtime.families import check_splittable

    check_splittable(path)
    ident = await asyncio.to_thread(model_identity, path, not trust_weights)
    costs = await asyncio.to_thread(layer_costs, path, ident.n_layers)
    return ident, costs


async def push_assignments(
    n_peers: int,
    model: Path,
    secret: ClusterSecret,
    control: str,
    discovery: Discovery,
    *,
    cluster_name: str = "mlxcel-cluster",
    secret_file: str | None = None,
    dry_run: bool = False,
    trust_weights: bool = False,
) -> BringupPlan:
    """Resolve ``n_peers`` peers, plan, and (unless ``dry_run``) push every stage. Returns the
    plan once every peer activated (a dry run: once every peer accepted an offer and said what
    it can hold; its offers are then aborted); raises :class:`BringupFailed` naming what went
    wrong."""
    ident, costs = await _model_facts(model, trust_weights)
    host, port = split_hostport(control)
    cfg = PushConfig(
        attempt=secrets.randbits(63),
        n_peers=n_peers,
        coordinator=control,
        version=__version__,
        cluster_name=cluster_name,
        model=ident,
        costs=costs,
        peers=discovery.peers,
        gate=(
            BeaconGate(beacon_key(secret.value), __version__, cluster_name)
            if discovery.mode == "mdns"
            else None
        ),
        secret_file=secret_file,
        dry_run=dry_run,
    )
    async with Node("bringup-coordinator") as node:
        pool = _assignment_pool(node, secret, host, port)
        receiver = None
        if discovery.mode == "mdns":
            receiver = BeaconReceiver("0.0.0.0", discovery.port, shaped=looks_like_beacon)
            await receiver.start()
            node.on_close(_closer(receiver.close))

        async def verify(address: str, deadline: float) -> None:
            # The handshake proves the secret at that very address (a busy peer is dialed
            # again until the deadline); the connection stays pooled for the offer.
            await pool.get(*split_hostport(address), deadline)

        core = PushCore(cfg, node_now())
        service = PushService(node, TcpEndpoint(control, pool), core, receiver, verify)
        service.attach()
        done = await service.result
        await service.flush(service.now() + FRAME_BOUND)  # Abort frames, if any, leave first
        plan = service.push.plan
    if not done.ok or plan is None:
        raise BringupFailed(done.summary)
    logger.info("{}", done.summary)
    return plan


def _assignment_pool(node: Node, secret: ClusterSecret, host: str, port: int) -> ConnectionPool:
    """The coordinator's dials on the assignment channel, from its control address."""
    return ConnectionPool(
        node,
        secret,
        Identity(host, port, "coordinator"),
        channel=Channel.ASSIGNMENT,
        backoff=Backoff(attempts=1, base_delay=0.5),  # the core retries every 0.5 s
        bind_ip=host,
        handshake_timeout=HANDSHAKE_BOUND,
        frame_timeout=FRAME_BOUND,
        peer_timeout=None,  # the push bounds its phases itself (see PEER_LIMITS)
    )


def node_now() -> float:
    return asyncio.get_running_loop().time()


def _closer(fn: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        fn()

    return close


@dataclass(frozen=True)
class Received:
    cluster: ClusterConfig
    node_id: str
    text: str  # the peer's file: the received body under the peer's header


async def await_assignment(
    model: Path,
    secret: ClusterSecret,
    listen: str | None,
    discovery: Discovery,
    *,
    cluster_name: str = "mlxcel-cluster",
    trust_weights: bool = False,
    memory: int = 0,
) -> Received:
    """Listen for an assignment until one is activated; raise :class:`AssignmentRefused` when
    the peer must end (an offer it can never accept, or none within 600 s)."""
    ident, costs = await _model_facts(model, trust_weights)
    host, port = split_hostport(listen) if listen else ("0.0.0.0", 0)
    async with Node("bringup-peer") as node:
        # A beacon target that is the coordinator's own IP names the one member this
        # listener expects: its dials then never wait behind an outsider's.
        members = [discovery.target] if discovery.mode == "mdns" else []
        listener = ClusterListener(
            node,
            secret,
            host,
            port,
            node_id="peer",
            channel=Channel.ASSIGNMENT,
            limits=PEER_LIMITS,
            members=members,
        )
        port = await listener.start()
        announce = None
        if discovery.mode == "mdns":
            announce = _announcer(node, secret, discovery, cluster_name, host, port)
        facts = PeerFacts(
            __version__,
            cluster_name,
            ident,
            lambda n, k, memory: derived_range(costs, n, k, memory),
            parse_cluster_toml,
            host,
            port,
            beacons=discovery.mode == "mdns",
            memory=memory,
        )
        logger.info(
            "mlxcel peer waiting for a stage assignment on {}:{} (offering {} for its stage)",
            host,
            port,
            human_bytes(memory) if memory else "an unsaid amount of memory",
        )
        service = PeerService(
            node, ReplyEndpoint(f"{host}:{port}", listener), PeerCore(facts, node_now()), announce
        )
        service.attach()
        try:
            activated = await service.result
        finally:
            await service.flush(service.now() + FRAME_BOUND)  # the last answer leaves first
    cfg = ClusterConfig.model_validate(tomllib.loads(activated.cluster_toml))
    text = peer_file(activated.node_id, activated.coordinator, activated.cluster_toml)
    return Received(cfg, activated.node_id, text)


def _announcer(
    node: Node, secret: ClusterSecret, discovery: Discovery, cluster_name: str, host: str, port: int
) -> Callable[[], None]:
    """The peer's beacons (closed with ``node``), announcing its assignment listener."""
    sender = BeaconSender(discovery.target, discovery.port, host)
    node.on_close(_closer(sender.close))
    # Announce a concrete IP (the one the beacons leave from), never 0.0.0.0: the
    # coordinator accepts a beacon only from the IP it names.
    unspecified = ipaddress.ip_address(host).is_unspecified
    ip = route_ip(discovery.target) if unspecified else host
    key = beacon_key(secret.value)
    return beacon_announcer(sender, key, __version__, cluster_name, Identity(ip, port).address)


@dataclass(frozen=True)
class Previous:
    """The cluster a ``--pp-auto`` coordinator wrote last time, and which of its stages serve
    now (a stage outlives its coordinator: a peer, once activated, no longer waits for an
    assignment, so a second bring-up could never find it)."""

    path: Path
    cluster: ClusterConfig
    up: tuple[str, ...]  # stage addresses where a stage of this cluster answers
    down: tuple[str, ...]  # nothing there, or a peer still waiting for an assignment


async def previous_cluster(
    path: Path, secret: ClusterSecret, timeout: float = HANDSHAKE_BOUND
) -> Previous | None:
    """``path``'s cluster and the state of its stages; None when there is no such file (or
    it is no cluster: then the bring-up simply writes it again). A stage serves where a
    handshake on the cluster's transport channel succeeds, dialed as the coordinator from
    its address: a waiting peer (same address, assignment channel) or anything else does
    not count."""
    try:
        cfg = parse_cluster_toml(path.read_text())
    except (OSError, ValueError):
        return None
    me = cfg.coordinator
    async with Node("bringup-recheck") as node:
        pool = ConnectionPool(
            node,
            secret,
            Identity(me.host, me.port, me.id),
            backoff=Backoff(attempts=1, base_delay=0.1),
            bind_ip=me.host,
            handshake_timeout=timeout,
        )

        async def serves(address: str) -> bool:
            try:
                await pool.get(*split_hostport(address), node_now() + timeout, attempts=1)
            except (MlxcelError, OSError):
                return False
            return True

        stages = [n.address for n in cfg.stages]
        states = await asyncio.gather(*(serves(a) for a in stages))
    up = tuple(a for a, ok in zip(stages, states, strict=True) if ok)
    return Previous(path, cfg, up, tuple(a for a in stages if a not in up))


def readopt(previous: Previous, n_peers: int) -> ClusterConfig | None:
    """The previous cluster to serve again when all its stages run (a restarted coordinator
    takes them back; the coordinator checks their layers and weights as always); None when
    none runs (a fresh bring-up). Raises :class:`BringupFailed`, saying what to do, when only
    some run or they are not the ``n_peers`` asked for: a bring-up would find none of them."""
    cfg, up, down = previous.cluster, previous.up, previous.down
    if not up:
        return None
    again = f"--distributed-config {previous.path} --node-id {cfg.coordinator.id}"
    if down:
        raise BringupFailed(
            f"{len(up)} of {len(cfg.stages)} stages of the cluster in {previous.path} are still "
            f"serving ({', '.join(up)}; not {', '.join(down)}): restart the missing ones with "
            f"the same --distributed-config and --node-id and serve with {again}, or stop "
            "them all and start every peer again with --pp-peer"
        )
    if len(up) != n_peers:
        raise BringupFailed(
            f"the {len(up)} stages of the cluster in {previous.path} are serving, but "
            f"--pp-auto asks for {n_peers}: serve them with {again}, or stop them and start "
            "every peer again with --pp-peer"
        )
    return cfg


def write_config(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


__all__ = [
    "AssignmentRefused",
    "BringupFailed",
    "Discovery",
    "Previous",
    "Received",
    "await_assignment",
    "check_local",
    "control_address",
    "previous_cluster",
    "push_assignments",
    "readopt",
    "write_config",
]

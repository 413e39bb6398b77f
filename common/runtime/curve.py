"""CURVE security for every ZeroMQ socket: key files, the keys of each side, and the one
ZAP authenticator per context that decides who may connect.

A key directory (``pdserve keys --dir DIR``) holds::

    server.key, server.key_secret   every bound socket: router front door, prefill and
                                    decode ROUTERs, prefill side channels
    client.key, client.key_secret   the deployment's own connections (router -> services,
                                    decode -> prefill side channels)
    <name>.key, <name>.key_secret   an SDK user's pair (``pdserve keys --client NAME``)
    authorized_keys/*.key           SDK users let in at the router's front door;
                                    removing one locks its owner out

Every bound socket encrypts with the server pair and asks its context's authenticator
about each peer. Two ZAP domains: the router's front door lets in the deployment's own
client key and every key in ``authorized_keys``; the internal sockets (the services'
ROUTERs, the side channels) only the deployment's own client key, so an SDK user cannot
reach a prefill or decode directly. A refused key is logged (``curve_refused``) and
counted (``pdserve:auth_failures``), and so is a peer without CURVE or with a wrong
server key (``handshake_failed``, seen by a socket monitor). ``authorized_keys`` is
re-read when it changes: keys are added or revoked without a restart (a connection
already made stays until it drops).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from pdserve.common.errors import PdserveError

if TYPE_CHECKING:
    from pdserve.common.runtime.instance_config import SecurityConfig
    from pdserve.common.runtime.metrics import Metrics

log = structlog.get_logger("pdserve.curve")

SERVER = "server"
CLIENT = "client"
AUTHORIZED = "authorized_keys"
FRONT_DOMAIN = "pdserve-front"  # the router's front door: SDK users
INTERNAL_DOMAIN = "pdserve-internal"  # services' and side-channel sockets: the deployment only
# Handshake failures that never reach the authenticator: no CURVE at all, a wrong server
# key (the HELLO cannot be decrypted), a mangled handshake.
_KEY_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
LOG_EVERY_S = 10.0  # a refused peer reconnects every few seconds: one log line per key this often
HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


@dataclass(frozen=True)
class CurveKeys:
    """One side's CURVE settings (z85 keys). A client names the server's public key; a
    server names the directory of client keys it lets in."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes | None = None  # client side: the public key of the server it connects to
    # server side: the deployment's own client key (let in everywhere), and for the front
    # door the directory of the SDK users' keys (let in there only)
    internal_key: bytes | None = None
    authorized_dir: Path | None = None
    on_refused: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (self.server_key is None) == (self.internal_key is None):
            raise ValueError("CurveKeys is either a client (server_key) or a server (internal_key)")

    @property
    def domain(self) -> str:
        return FRONT_DOMAIN if self.authorized_dir is not None else INTERNAL_DOMAIN

    @classmethod
    def client(cls, keys_dir: str | Path, name: str = CLIENT) -> CurveKeys:
        """A client's keys from a key directory: its own pair and the server's public key."""
        directory = Path(keys_dir).expanduser()
        public, secret = _load_pair(directory, name)
        server, _ = _load_pair(directory, SERVER, public_only=True)
        return cls(public_key=public, secret_key=secret, server_key=server)

    @classmethod
    def server(cls, keys_dir: str | Path, on_refused: Callable[[], None] | None = None,
               front: bool = False) -> CurveKeys:  # fmt: skip
        """A server's keys; ``front``: the router's front door, which also lets in the
        keys in ``authorized_keys``."""
        directory = Path(keys_dir).expanduser()
        public, secret = _load_pair(directory, SERVER)
        internal, _ = _load_pair(directory, CLIENT, public_only=True)
        authorized = directory / AUTHORIZED
        if front and not authorized.is_dir():
            raise PdserveError(f"CURVE key directory {directory} has no {AUTHORIZED}/; "
                               f"create one with `pdserve keys --dir {directory}`")  # fmt: skip
        return cls(public_key=public, secret_key=secret, internal_key=internal,
                   authorized_dir=authorized if front else None, on_refused=on_refused)  # fmt: skip

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Set the socket's CURVE options (before bind or connect)."""
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        if self.server_key is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_key)
        else:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.ZAP_DOMAIN, self.domain.encode())


@dataclass(frozen=True)
class WireSecurity:
    """A process's CURVE keys: ``server`` for the internal sockets it binds, ``front`` for
    the router's front door, ``client`` for the sockets it connects; all None when
    security is off."""

    server: CurveKeys | None = None
    front: CurveKeys | None = None
    client: CurveKeys | None = None

    @classmethod
    def from_dir(
        cls,
        keys_dir: str,
        on_refused: Callable[[], None] | None = None,
        internal_dir: str = "",
    ) -> WireSecurity:
        """``keys_dir``: CURVE everywhere, the front door included; else ``internal_dir``:
        CURVE on the internal sockets only (the front door open); neither: off."""
        if keys_dir:
            return cls(server=CurveKeys.server(keys_dir, on_refused),
                       front=CurveKeys.server(keys_dir, on_refused, front=True),
                       client=CurveKeys.client(keys_dir))  # fmt: skip
        if internal_dir:
            return cls(server=CurveKeys.server(internal_dir, on_refused),
                       client=CurveKeys.client(internal_dir))  # fmt: skip
        return cls()

    @classmethod
    def counted(cls, security: SecurityConfig, metrics: Metrics) -> WireSecurity:
        """From the ``[security]`` config, refusals counted in ``pdserve:auth_failures``;
        internal sockets without CURVE are logged (a warning: any local process reaches them)."""
        if not security.internal_keys:
            log.warning(
                "internal_curve_off",
                why="insecure = true" if security.insecure else "no CURVE keys configured",
                hint="any process that reaches the services' ports may send them requests; "
                "`pdserve up` makes keys unless --insecure, systemd units use `pdserve keys`",
            )
            return cls()
        metrics.declare("pdserve:auth_failures")
        return cls.from_dir(
            security.curve_keys_dir,
            lambda: metrics.inc("pdserve:auth_failures"),
            security.internal_keys_dir,
        )


def make_runtime_keys() -> Path:
    """A fresh key directory for one `pdserve up`: private (0700, under $XDG_RUNTIME_DIR
    when there is one), removed when the deployment stops."""
    import tempfile

    runtime = os.environ.get("XDG_RUNTIME_DIR")
    parent = runtime if runtime and os.path.isdir(runtime) else None
    directory = Path(tempfile.mkdtemp(prefix="pdserve-keys-", dir=parent))  # 0700
    create_keys(directory)
    return directory


def create_keys(keys_dir: str | Path, clients: tuple[str, ...] = ()) -> list[Path]:
    """Create the missing key pairs of a key directory (existing ones are kept) and
    authorize the SDK clients' pairs at the front door. Returns the files written."""
    directory = Path(keys_dir).expanduser()
    authorized = directory / AUTHORIZED
    authorized.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    written: list[Path] = []
    for name in clients:
        if not _KEY_NAME.fullmatch(name) or name in (SERVER, AUTHORIZED):
            raise PdserveError(f"bad client key name {name!r}: use letters, digits, '-' or '_' "
                               f"(not {SERVER!r} or {AUTHORIZED!r})")  # fmt: skip
    for name in (SERVER, CLIENT, *clients):
        public = directory / f"{name}.key"
        if not public.exists():
            public_path, secret_path = zmq.auth.create_certificates(directory, name)
            Path(secret_path).chmod(0o600)
            written += [Path(public_path), Path(secret_path)]
        if name in clients and not (authorized / public.name).exists():
            shutil.copyfile(public, authorized / public.name)
            written.append(authorized / public.name)
    return written


def _load_pair(directory: Path, name: str, public_only: bool = False) -> tuple[bytes, bytes]:
    path = directory / (f"{name}.key" if public_only else f"{name}.key_secret")
    if not path.is_file():
        raise PdserveError(f"CURVE key {path} does not exist; create keys with "
                           f"`pdserve keys --dir {directory}`")  # fmt: skip
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise PdserveError(f"cannot load CURVE key {path}: {exc}; create keys with "
                           f"`pdserve keys --dir {directory}`") from None  # fmt: skip
    if not public_only and not secret:
        raise PdserveError(f"{path} holds no secret key")
    return public, secret or b""


# -- the authenticator ------------------------------------------------------------------------


class _Authorized:
    """The credentials provider: the deployment's own client key everywhere; at the front
    door also the public keys in a directory, re-read when it changes."""

    def __init__(self, internal_key: bytes, on_refused: Callable[[], None] | None) -> None:
        self.internal_key = internal_key  # z85, as the ZAP request's key
        self.directory: Path | None = None  # set by the front door's keys
        self.on_refused = on_refused
        self.peer = "?"  # the address of the handshake being decided (set before each call)
        self._state: Any = ()  # what the directory looked like when last read
        self._keys: set[bytes] = set()
        self._logged: dict[bytes, float] = {}  # key -> when it was last logged

    def callback(self, domain: str, key: bytes) -> bool:
        try:
            return self._decide(domain, key)
        except Exception:  # the ZAP handler must never die: nobody could connect any more
            log.exception("curve_check_failed", peer=self.peer, domain=domain)
            return False

    def _decide(self, domain: str, key: bytes) -> bool:
        if key == self.internal_key:
            return True
        if domain == FRONT_DOMAIN and self.directory is not None:
            self._reload(self.directory)
            if key in self._keys:
                return True
        if self.on_refused is not None:
            self.on_refused()
        now = time.monotonic()
        if (
            now - self._logged.get(key, -LOG_EVERY_S) >= LOG_EVERY_S
        ):  # it retries: log it once a while
            if len(self._logged) > 1000:
                self._logged.clear()
            self._logged[key] = now
            hint = ("the client's public key is not in authorized_keys" if domain == FRONT_DOMAIN
                    else "an internal socket: only the deployment's own client key may connect")  # fmt: skip
            log.warning("curve_refused", peer=self.peer, client_key=key.decode(errors="replace"),
                        domain=domain, authorized_keys=str(self.directory), hint=hint)  # fmt: skip
        return False

    def _reload(self, directory: Path) -> None:
        try:  # the names too: a coarse mtime misses an add and a remove within its tick
            state: Any = (directory.stat().st_mtime_ns, frozenset(os.listdir(directory)))
        except OSError:
            state = None
        if state == self._state:
            return
        self._state = state
        try:
            self._keys = set(zmq.auth.load_certificates(directory))
        except (OSError, ValueError) as exc:  # nobody gets in rather than everybody
            log.error("curve_keys_unreadable", authorized_keys=str(directory), error=str(exc))
            self._keys = set()


class _PeerAware:
    """Remembers the peer address of the ZAP request being decided, for the log."""

    provider: _Authorized

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self.provider.peer = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)  # type: ignore[misc]


class _AsyncioAuth(_PeerAware, AsyncioAuthenticator):
    pass


_authenticators: weakref.WeakKeyDictionary[zmq.Context[Any], Any] = weakref.WeakKeyDictionary()


def ensure_authenticator(ctx: zmq.Context[Any], keys: CurveKeys) -> None:
    """One ZAP handler per context, started before its first CURVE server socket binds
    (without one, libzmq lets any CURVE client in), on the running asyncio loop."""
    auth = _authenticators.get(ctx)
    if auth is None:
        assert keys.internal_key is not None
        if not isinstance(ctx, zmq.asyncio.Context):  # every pdserve server runs on asyncio
            raise ValueError(
                "a CURVE server socket needs an asyncio context (its authenticator runs on the loop)"
            )
        auth = _AsyncioAuth(ctx)
        auth.provider = _Authorized(keys.internal_key, keys.on_refused)
        auth.start()
        for domain in ("*", FRONT_DOMAIN, INTERNAL_DOMAIN):  # "*": a socket without a domain
            auth.configure_curve_callback(domain, auth.provider)
        _authenticators[ctx] = auth
    if keys.authorized_dir is not None:
        auth.provider.directory = keys.authorized_dir


def handshake_events(keys: CurveKeys) -> int:
    """The monitor events that mean a failed handshake on this side (a server's refusals
    by key are the authenticator's to count: not among them)."""
    if keys.server_key is None:
        return HANDSHAKE_FAILURES
    return HANDSHAKE_FAILURES | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def watch_handshakes(sock: zmq.Socket[Any], address: str, keys: CurveKeys) -> None:
    """Log failed handshakes, and count them on a server (where the authenticator is not
    asked: no CURVE, a wrong server key). Asyncio sockets only: a task reads the socket's
    monitor until the socket or context closes. A socket has one monitor: one made with
    ``make_socket(monitor_events=...)`` is its caller's, who passes the events to
    :class:`HandshakeLog`."""
    if not isinstance(sock, zmq.asyncio.Socket):
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    monitor = sock.get_monitor_socket(handshake_events(keys), addr=monitor_address())
    task = loop.create_task(_watch(monitor, HandshakeLog(address, keys)))
    _monitor_tasks.add(task)
    task.add_done_callback(_monitor_tasks.discard)


_monitor_tasks: set[asyncio.Task[None]] = set()


def monitor_address() -> str:
    """A fresh inproc endpoint for a socket's monitor (pyzmq's default names it after the
    socket's file descriptor, which a socket made after a closed one may reuse)."""
    return f"inproc://pdserve-monitor-{uuid.uuid4().hex}"


def describe_failure(event: int, is_server: bool = False) -> str:
    """What a failed handshake most likely means, for a person."""
    if is_server:  # libzmq tells a server little: both cases look alike
        return "a peer without CURVE keys, or with a wrong server public key"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "the server refused this client's CURVE key (not in its authorized_keys)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return "one side uses CURVE and the other does not (security settings differ)"
    return "the handshake failed: most likely a wrong server public key"


class HandshakeLog:
    """Counts (on a server) and logs (at most once every LOG_EVERY_S: refused peers
    retry) the failed handshakes of one socket, from its monitor's events."""

    def __init__(self, address: str, keys: CurveKeys) -> None:
        self.address = address
        self.keys = keys
        self.events = handshake_events(keys)
        self._last_log = -LOG_EVERY_S

    def __call__(self, event: int) -> None:
        """Take one monitor event; those that are not failed handshakes are ignored."""
        if not event & self.events:
            return
        is_server = self.keys.server_key is None
        if is_server and self.keys.on_refused is not None:
            self.keys.on_refused()
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.warning("handshake_failed", address=self.address, side="server" if is_server else "client",
                        zmq_event=zmq.Event(event).name, hint=describe_failure(event, is_server))  # fmt: skip


async def _watch(monitor: zmq.asyncio.Socket, report: HandshakeLog) -> None:
    while True:
        try:
            event = parse_monitor_message(await monitor.recv_multipart())
        except (zmq.ZMQError, asyncio.CancelledError):  # the socket or context closed
            return
        report(event["event"])

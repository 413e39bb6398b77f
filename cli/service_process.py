"""The launcher's side of the service zygote (cli/zygote.py): start one, ask it for
children, and handle each child as a ``subprocess.Popen`` (:class:`ServiceProcess`).

The zygote reaps its children and reports their exit codes on the control socket (a
``SOCK_SEQPACKET`` pair: one msgpack message a packet); the launcher reads them when it
polls or waits. A zygote serves only children whose environment differs from its own in
variables read at run time (``PDSERVE_*``): :func:`zygote_for` starts one per distinct rest.
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict

import msgspec

from pdserve.common.errors import PdserveError

SPAWN_TIMEOUT = 300.0  # the first spawn waits for the zygote's imports
LOST = 255  # the exit code of a child whose zygote died before it (its own is unknown)


class Spawn(msgspec.Struct, tag=True):
    name: str  # the child's command line (``ps -eo args``): pdserve-NAME
    args: list[str]  # pdserve's arguments, as after ``python -m pdserve``
    env: dict[str, str]
    cwd: str
    log: str
    append: bool


class Started(msgspec.Struct, tag=True):
    pid: int


class SpawnFailed(msgspec.Struct, tag=True):
    error: str


class Exited(msgspec.Struct, tag=True):
    pid: int
    code: int  # as Popen.returncode: -N for a signal


Reply = Started | SpawnFailed | Exited
encode = msgspec.msgpack.Encoder().encode
decode_spawn = msgspec.msgpack.Decoder(Spawn).decode
_decode_reply = msgspec.msgpack.Decoder(Reply).decode


class ServiceProcess:
    """A child of a zygote, handled as a ``subprocess.Popen``."""

    def __init__(self, zygote: Zygote, pid: int, name: str) -> None:
        self.zygote = zygote
        self.pid = pid
        self.name = name
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote.pump(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pdserve {self.name}", timeout or 0.0)
            self.zygote.pump(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # exited, its exit not read yet
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's end of one zygote process (started here, with ``env``)."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli.zygote", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C is the launcher's to handle
        )
        theirs.close()
        self._sock = ours
        self._lock = threading.RLock()
        self._children: dict[int, ServiceProcess] = {}  # those whose exit is not read yet
        self.closed = False

    def spawn(
        self, name: str, args: list[str], env: dict[str, str], log: str, append: bool
    ) -> ServiceProcess:
        req = Spawn(name, args, env, os.getcwd(), log, append)
        with self._lock:
            if self.closed:
                raise PdserveError("the service zygote has ended")
            try:
                self._sock.send(encode(req))
            except OSError as exc:
                self._lost()
                raise PdserveError(f"the service zygote has ended ({exc})") from exc
            deadline = time.monotonic() + SPAWN_TIMEOUT
            while True:
                left = deadline - time.monotonic()
                reply = self._recv(left) if left > 0 else None
                if reply is None:
                    code = self.proc.poll()
                    self._lost()
                    raise PdserveError(
                        f"the service zygote did not start {name} "
                        f"(zygote exit code {code}; its errors go to this process's stderr)"
                    )
                if isinstance(reply, Exited):
                    self._exited(reply)
                elif isinstance(reply, SpawnFailed):
                    raise PdserveError(f"could not start {name}: {reply.error}")
                else:
                    # (the zygote reports a child's exit only after its Started)
                    child = ServiceProcess(self, reply.pid, name)
                    self._children[reply.pid] = child
                    return child

    def pump(self, timeout: float | None) -> None:
        """Read the zygote's reports, waiting up to ``timeout`` for the first one."""
        with self._lock:
            reply = self._recv(timeout)
            while reply is not None:
                if isinstance(reply, Exited):
                    self._exited(reply)
                reply = self._recv(0.0)

    def _recv(self, timeout: float | None) -> Reply | None:
        if self.closed:
            self._check_lost_children()
            if timeout:
                time.sleep(min(timeout, 0.05))
            return None
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return None
        try:
            data = self._sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._lost()
            return None
        return _decode_reply(data)

    def _exited(self, msg: Exited) -> None:
        child = self._children.pop(msg.pid, None)
        if child is not None:
            child.returncode = msg.code

    def _lost(self) -> None:
        """The zygote ended: its children got SIGTERM; their exit codes are unknowable."""
        if not self.closed:
            self.closed = True
            self._sock.close()
        self._check_lost_children()

    def _check_lost_children(self) -> None:
        for pid, child in list(self._children.items()):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                child.returncode = LOST
                del self._children[pid]

    def busy(self) -> bool:
        """Whether a child of this zygote may still be running."""
        self.pump(0.0)
        return bool(self._children)

    def close(self) -> None:
        """End the zygote (children still running get SIGTERM)."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self._sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# What a zygote's environment may differ in from a child's: variables read only at run time,
# never while the preloaded modules load. pytest sets PYTEST_CURRENT_TEST at every test
# phase (else each test would start a zygote of its own), torch sets
# TORCHINDUCTOR_CACHE_DIR to its default once something in the process compiled.
RUN_TIME_PREFIXES = ("PDSERVE_",)
RUN_TIME_NAMES = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})
KEEP_ZYGOTES = 2  # idle zygotes of other environments kept for reuse, the least recent ended

_zygotes: OrderedDict[tuple[tuple[str, str], ...], Zygote] = OrderedDict()
_zygotes_lock = threading.Lock()


def zygote_for(env: dict[str, str]) -> Zygote:
    """This process's zygote for children with environment ``env``: one per distinct
    environment outside the run-time variables above, started on first use, ended at exit
    (or once KEEP_ZYGOTES more recently used ones exist and it has no child left)."""
    base = {
        k: v
        for k, v in env.items()
        if not k.startswith(RUN_TIME_PREFIXES) and k not in RUN_TIME_NAMES
    }
    key = tuple(sorted(base.items()))
    with _zygotes_lock:
        zyg = _zygotes.get(key)
        if zyg is None or zyg.closed or zyg.proc.poll() is not None:
            if not _zygotes:
                atexit.register(_close_all)
            zyg = _zygotes[key] = Zygote(base)
        _zygotes.move_to_end(key)
        for old_key, old in list(_zygotes.items())[: -1 - KEEP_ZYGOTES]:
            if not old.busy():
                old.close()
                del _zygotes[old_key]
        return zyg


def _close_all() -> None:
    for zyg in _zygotes.values():
        zyg.close()

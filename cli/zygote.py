"""Service processes forked from a process that imported their code once: a zygote.

``pdserve up`` (cli/deployment.py) runs router, prefill and decode as processes of their
own. Each was a fresh interpreter that imported torch and the service code again (~1.8 s
of CPU a process). A zygote imports them once (PRELOAD), then forks a child per service
on request. The child makes itself what ``python -m pdserve ROLE ...`` would be: a
command line that names it (``pdserve-decode-0``: setproctitle), a session of its own,
the environment and working directory it was given, its log file as stdout and stderr,
/dev/null as stdin, default signal handlers; it runs ``pdserve.cli.main.main(args)`` and
exits with its code after the interpreter's exit steps (non-daemon threads joined, atexit
handlers run). The zygote reaps its children and reports each exit code, so the
launcher's handle (cli/service_process.py) reads as a ``subprocess.Popen`` does:
``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``.

Lifetimes: a zygote ends when its launcher closes the control socket, or dies (the
kernel closes it then). Every child has SIGTERM sent to it when its zygote ends
(PR_SET_PDEATHSIG) and drains as a stopped service does: a launcher never leaves
services behind.

What a child shares with its zygote that a fresh interpreter would not have: what the
preloaded modules did at import. They read no environment at import (a child's
environment is set after the fork), start no thread, open no socket or NIXL agent and
touch no GPU. Variables read when a process starts (glibc's ``MALLOC_*``, OpenMP's,
``PYTHON*``, ``LD_*``) take the zygote's values, so a zygote serves only children whose
environment differs from its own in variables read only at run time (``PDSERVE_*``,
pytest's ``PYTEST_CURRENT_TEST``; cli/service_process.py's ``zygote_for`` keys zygotes by
the rest). The string-hash seed is the zygote's.
"""

from __future__ import annotations

import atexit
import importlib
import os
import select
import signal
import socket
import sys
import threading
import traceback

import setproctitle

from pdserve.cli.service_process import Exited, Spawn, SpawnFailed, Started, decode_spawn, encode

# What a service imports before it serves (measured with python -X importtime): torch and
# the model code (prefill, decode), the HTTP stack and the tokenizer (router), and NIXL's
# UCX plugin (common/transfer/nixl_libs.py: UCX's libraries read only their process-wide
# settings when they load). Nothing here may start a thread, open a socket or read the
# environment at import, but for those UCX settings.
PRELOAD = [
    "torch",
    "pdserve.common.transfer.nixl_libs",
    "uvloop",
    "safetensors",
    "aiohttp.web",
    "concurrent.futures.process",
    "pdserve.cli.main",
    "pdserve.common.runtime.log",
    "pdserve.common.engine.model_runner",
    "pdserve.common.model.checkpoint.files",
    "pdserve.services.prefill.service",
    "pdserve.services.decode.service",
    "pdserve.services.router.main",
    "pdserve.services.router.front",
    "pdserve.services.router.http_api",
    "pdserve.services.router.tokenize_pool",
]

_PR_SET_PDEATHSIG = 1


def _prctl(option: int, arg: int) -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg, 0, 0, 0)
    except OSError:  # not glibc Linux: no parent-death signal
        pass


def serve(sock: socket.socket) -> None:
    """The zygote's loop: fork on each Spawn, report each exit, end with the socket."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pipe = [wake_r, wake_w]
    try:
        while True:
            ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
            if wake_r in ready:
                while True:
                    try:
                        if not os.read(wake_r, 512):
                            break
                    except BlockingIOError:
                        break
            _reap(sock)
            if sock.fileno() in ready:
                data = sock.recv(1 << 20)
                if not data:
                    return  # the launcher closed its end, or died
                req = decode_spawn(data)
                try:
                    pid = os.fork()
                except OSError as exc:
                    sock.send(encode(SpawnFailed(f"fork failed: {exc}")))
                    continue
                if pid == 0:
                    _run_child(req, sock, pipe)  # never returns
                sock.send(encode(Started(pid)))
    except (BrokenPipeError, ConnectionResetError):
        return


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(encode(Exited(pid, os.waitstatus_to_exitcode(status))))


def _run_child(req: Spawn, sock: socket.socket, pipe: list[int]) -> None:
    code = 1
    try:
        code = _child(req, sock, pipe)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
    finally:
        try:  # the interpreter's own exit steps, which os._exit skips
            shutdown = getattr(threading, "_shutdown", None)
            if shutdown is not None:
                shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            traceback.print_exc()
        os._exit(code)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _child(req: Spawn, sock: socket.socket, pipe: list[int]) -> int:
    zygote = os.getppid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock.close()  # the zygote's control socket and wake-up pipe are not the child's
    for fd in pipe:
        os.close(fd)
    os.setsid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != zygote:  # the zygote ended before the line above
        os.kill(os.getpid(), signal.SIGTERM)
    # The whole command line (``ps -eo args``), not only prctl's name of 15 characters
    # (``pdserve-decode-``): else every child shows the zygote's, and instances look alike.
    setproctitle.setproctitle(f"pdserve-{req.name}")
    log = os.open(
        req.log, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if req.append else os.O_TRUNC), 0o666
    )
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.environ.clear()
    os.environ.update(req.env)
    os.chdir(req.cwd)
    import pdserve.__main__ as entry

    sys.argv = [entry.__file__ or "pdserve", *req.args]
    from pdserve.cli.main import main

    return main(req.args)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        importlib.import_module(name)
    serve(sock)


if __name__ == "__main__":
    main()

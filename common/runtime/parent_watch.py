"""End a child process when the process that started it is gone.

A child blocked where it never hears from its parent outlives a SIGKILLed parent: a rank
process still loading the model or waiting in gloo's rendezvous (its pipe unread), or the
router's tokenising worker, which holds both ends of its task queue's pipe and so never
reads EOF. Each starts :func:`exit_with_parent` first thing.

A rank is forked by a multiprocessing forkserver (services/ranks/group.py), not by the
service, and a forkserver outlives its client while any child it forked lives: a rank
therefore watches the service's pid (``owner``), not its own parent's.
"""

from __future__ import annotations

import os
import select
import threading
import time


def exit_with_parent(owner: int | None = None, period: float = 0.5) -> None:
    """A daemon thread that ends this process (``os._exit(1)``) once ``owner`` (default:
    this process's parent) has ended. Watched through a pidfd (no pid-reuse race), else by
    polling for the parent to change."""
    parent = os.getppid()
    pid = parent if owner is None else owner
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone before this child got here
        os._exit(1)
    except (AttributeError, OSError):  # no pidfds (not Linux >= 5.3)
        pidfd = -1

    def watch_pidfd() -> None:
        select.select([pidfd], [], [])  # readable once the process has exited
        os._exit(1)

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(period)
        os._exit(1)

    if pidfd < 0 and pid != parent:
        raise RuntimeError(f"no pidfd to watch process {pid}, which is not this one's parent")
    target = watch_pidfd if pidfd >= 0 else watch_parent
    threading.Thread(target=target, name="pdserve-parent-watch", daemon=True).start()

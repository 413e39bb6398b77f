"""End a child process when the process that started it is gone.

A child blocked where it never hears from its parent outlives a SIGKILLed parent: a rank
process still loading the model or waiting in gloo's rendezvous (its pipe unread), or the
router's tokenising worker, which holds both ends of its task queue's pipe and so never
reads EOF. Each starts :func:`exit_with_parent` first thing.
"""

from __future__ import annotations

import os
import threading
import time


def exit_with_parent(period: float = 0.5) -> None:
    """A daemon thread that ends this process (``os._exit(1)``) once its parent process has
    changed (it died and this one was re-parented)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="pdserve-parent-watch", daemon=True).start()

"""Transfer backends by name (``kv_transfer_backend``): the one line a new backend adds.

Each entry names the module and the ``TransferBackend`` object in it; the module is
imported only when the backend is asked for, so a backend's heavy imports (NIXL, UCX)
stay out of every process that does not use it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pdserve.common.errors import PdserveError

if TYPE_CHECKING:
    from pdserve.common.transfer.backend import TransferBackend

BACKENDS: dict[str, str] = {
    "nixl": "pdserve.common.transfer.nixl_backend:NIXL",
    # both engines in one process (tests): real copies between their caches, no NIXL
    "inprocess": "pdserve.common.transfer.inprocess:IN_PROCESS",
}


def transfer_backend(name: str) -> TransferBackend:
    """The backend registered as ``name``; a clear error for a name not registered."""
    entry = BACKENDS.get(name)
    if entry is None:
        raise PdserveError(
            f"unknown kv_transfer_backend {name!r}; known: {', '.join(sorted(BACKENDS))}"
        )
    module, attr = entry.split(":")
    backend: TransferBackend = getattr(importlib.import_module(module), attr)
    return backend

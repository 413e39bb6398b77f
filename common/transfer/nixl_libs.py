"""Importing this module loads NIXL's UCX plugin, and UCX's libraries with it, into the
process: the processes that fork others import it once (cli/zygote.py's PRELOAD, the rank
forkserver's RANK_PRELOAD in services/ranks/group.py), so that each child's first NIXL
agent starts in ~0.04 s of CPU instead of ~0.44 s, most of which is loading those
libraries (measured on the 2-core CI kind: a second agent in one process takes 0.05 s).

Loading runs UCX's library constructors, which read UCX's process-wide settings
(``UCX_LOG_LEVEL``, ``UCX_ERROR_SIGNALS``, ...) from this process's environment; the
settings of a context and its transports (``UCX_TLS``, ``UCX_NET_DEVICES``,
``UCX_CUDA_IPC_*``) are read when an agent starts, in the child. No thread starts and no
device is touched. Where NIXL or its UCX plugin is missing nothing is loaded: an agent
then fails as it would have (common/transfer/kv_transfer.py names the cause).
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path


def ucx_plugin_path() -> Path | None:
    """Where NIXL will load its UCX plugin from: ``NIXL_PLUGIN_DIR``, else the plugins
    directory its wheel ships (``.nixl_cu13.mesonpy.libs/plugins`` beside the package)."""
    try:
        import nixl._api as api
    except ImportError:
        return None
    if os.environ.get("NIXL_PLUGIN_DIR"):
        path = Path(os.environ["NIXL_PLUGIN_DIR"]) / "libplugin_UCX.so"
    else:
        package = api.__name__.split(".")[0]  # nixl_cu13, nixl_cu12 or nixl_rocm
        module = sys.modules[package].__file__
        if module is None:
            return None
        root = Path(module).parent.parent
        path = root / f".{package}.mesonpy.libs" / "plugins" / "libplugin_UCX.so"
    return path if path.is_file() else None


def load_ucx_plugin() -> bool:
    """dlopen the UCX plugin now; True when it is loaded."""
    path = ucx_plugin_path()
    if path is None:
        return False
    try:
        ctypes.CDLL(str(path))
    except OSError:
        return False
    return True


LOADED = load_ucx_plugin()

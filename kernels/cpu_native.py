"""Compiled CPU kernels: attention that reads the paged cache in place, and the pointwise ops
in one pass each.

The torch reference's decode attention (:func:`pdserve.kernels.reference.decode_attention`)
gathers every sequence's K and V into one padded tensor and then runs SDPA over it, so a
step reads the KV twice and writes it once. ``cpu_attention.cpp`` reads each K and V row
once, where it lies, for all the query heads of a KV head (online softmax over blocks,
torch's threads over (sequence, KV head) pairs): on the embedded model's shape, one layer
at 16 sequences of ~540 tokens 0.84 -> 0.35-0.41 ms, at 64 sequences 16.8 -> 1.4-1.6 ms
(`benchmarks/cpu_decode_attention.py`; benchmarks/README.md, "CPU decode attention, malloc").
Its prefill attention does the same for causal prompts and chunks (flash style, tiles of
query tokens, register-blocked QK^T and PV, GQA without repeating K/V): one layer, 4
prompts of 512 tokens 16.9 -> 5.1 ms (`benchmarks/cpu_prefill_attention.py`).
``cpu_pointwise.cpp`` holds RMSNorm (+ residual add), rotary (in place) and SiLU-and-mul,
one pass over memory each where the reference makes three to ten.

The source is built once per machine with torch's C++ extension builder (a C++ compiler,
Python's headers and ninja, which pip installs with pdserve; ~20 s on 2 cores) into the
``pdserve/`` folder of torch's extensions folder (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), under a name that hashes the source, the flags and the
CPU's feature flags (it is built with ``-march=native``); later processes import the built
library directly. When it cannot be built, the reason is logged once and the torch
reference serves. ``PDSERVE_KERNELS=torch`` uses the
reference only (the oracle the tests compare this kernel with).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import platform
from pathlib import Path
from typing import Any

import torch

SOURCES = tuple(Path(__file__).with_name(n) for n in ("cpu_attention.cpp", "cpu_pointwise.cpp"))
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _name() -> str:
    key = "\n".join(
        [
            *(s.read_text() for s in SOURCES),
            " ".join(CFLAGS + LDFLAGS),
            _cpu_flags(),
            torch.__version__,
        ]
    )
    return "pdserve_cpu_attention_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH: put the pip package's (a dependency) there
    when the interpreter runs from a virtual environment that is not activated."""
    try:
        import ninja  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        return
    bin_dir = str(getattr(ninja, "BIN_DIR", ""))
    path = os.environ.get("PATH", "")
    if bin_dir and bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, path]) if path else bin_dir


def build_dir(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / "pdserve" / name


def _import(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_or_build(name: str) -> Any:
    """A build finished earlier (its ``built`` mark written last) is imported straight, with
    no lock and no ninja run. Otherwise one process builds, under an flock that the kernel
    drops if that process dies (torch's own lock file, which a killed builder leaves behind
    and every later process would wait on forever, is removed under it first)."""
    folder = build_dir(name)
    library = folder / f"{name}.so"
    if not (folder / "built").exists():
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "pdserve.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / "built").exists():
                from torch.utils.cpp_extension import load as build

                (folder / "lock").unlink(missing_ok=True)
                _ninja_on_path()
                module = build(
                    name,
                    [str(s) for s in SOURCES],
                    extra_cflags=CFLAGS,
                    extra_ldflags=LDFLAGS,
                    build_directory=str(folder),
                )
                (folder / "built").write_text(str(library) + "\n")
                return module
    return _import(library, name)


@functools.cache
def load() -> Any | None:
    """The compiled module, built on first use; None (and the reason logged once) when it
    cannot be built here."""
    import structlog  # here: the kernels import with torch alone

    log = structlog.get_logger("pdserve.kernels")
    name = _name()
    try:
        module = _load_or_build(name)
    except Exception as exc:  # no compiler, no ninja, no Python headers: the reference serves
        lines = str(exc).strip().splitlines() or [""]
        log.warning(
            "cpu_attention_kernel_unavailable",
            reason=f"{type(exc).__name__}: {lines[-1][:300]}",
            fallback="torch reference (gather + SDPA)",
        )
        return None
    log.info("cpu_attention_kernel_loaded", name=name)
    return module


def decode_attention(
    q: torch.Tensor,  # [S, H_q, D]
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D]
    context_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_blocks]
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor | None:
    """The compiled kernel's result, or None where it does not apply (not float32 on CPU,
    rows not contiguous, no batch, a head_dim that is not a multiple of 16) or is not built:
    the caller then uses the reference."""
    if (
        q.device.type != "cpu"
        or q.dtype != torch.float32
        or layer_cache.dtype != torch.float32
        or layer_cache.stride(-1) != 1
        or q.shape[0] == 0
        or q.shape[-1] % 16
    ):
        return None
    module = load()
    if module is None:
        return None
    out: torch.Tensor = module.paged_decode(
        q, layer_cache, context_lens, block_tables, scale, sliding_window or 0
    )
    return out


def prefill_attention(
    q: torch.Tensor,  # [T, H_q, D], sequences back to back
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D], already holding the new K/V
    cu_seqlens_q: torch.Tensor,  # [S + 1]
    context_lens: torch.Tensor,  # [S], incl. the new tokens
    block_tables: torch.Tensor,  # [S, max_blocks]
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor | None:
    """The compiled prefill kernel's result (causal, over the paged cache in place, GQA
    without repeated K/V), or None where it does not apply (not float32 on CPU, a head_dim
    that is not a multiple of 16, no queries) or is not built: the caller then uses the
    reference."""
    if (
        q.device.type != "cpu"
        or q.dtype != torch.float32
        or layer_cache.dtype != torch.float32
        or layer_cache.stride(-1) != 1
        or q.shape[0] == 0
        or q.shape[-1] % 16
        or q.shape[-1] > 512
    ):
        return None
    module = load()
    if module is None:
        return None
    out: torch.Tensor = module.paged_prefill(
        q, layer_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window or 0
    )
    return out


def _rows_ok(*tensors: torch.Tensor) -> bool:
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors
    )


def rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight * normalise(x + residual), x + residual) in one pass, or None where the
    compiled op does not apply (not float32 rows on CPU) or is not built."""
    extra = () if residual is None else (residual,)
    if x.dim() != 2 or not _rows_ok(x, weight, *extra) or not weight.is_contiguous():
        return None
    module = load()
    if module is None:
        return None
    outs = module.rms_norm(x, weight, eps, residual)
    return outs[0], (outs[1] if residual is not None else None)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q and k rotated in place (views into one qkv row are fine), or None where the compiled
    op does not apply or is not built."""
    if q.dim() != 3 or not _rows_ok(q, k) or cos.dtype != torch.float32:
        return None
    module = load()
    if module is None:
        return None
    module.rotary(q, k, cos, sin)
    return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up in one pass, or None where the compiled op does not apply or is not
    built."""
    if gate_up.dim() != 2 or not _rows_ok(gate_up):
        return None
    module = load()
    if module is None:
        return None
    out: torch.Tensor = module.silu_and_mul(gate_up)
    return out

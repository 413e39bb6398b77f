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

The sources are built per ISA (``ISAS``: AVX-512, AVX2 + FMA, or portable x86-64 with
SSE2; a plain build elsewhere), each with its vector width and register blocking sized to
that ISA's registers (``#if`` in the sources; the library reports its ISA with ``isa()``),
and the best one the CPU runs (its ``/proc/cpuinfo`` flags) is loaded; if that one does not
build, the next one down. ``PDSERVE_CPU_ISA=avx512|avx2|portable`` forces one the CPU can
run (an AVX2 machine reproduced on an AVX-512 one; tests build every variant the CPU runs).
Each is built once per machine with torch's C++ extension builder (a C++ compiler, Python's
headers and ninja, which pip installs with pdserve; ~20 s on 2 cores) into the
``pdserve/`` folder of torch's extensions folder (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), under a name that holds the ISA and hashes the sources and
the flags; later processes import the built library directly. When none can be built, the
reason is logged once and the torch reference serves.

Each kernel is used only where it beats the reference on this CPU: the first time a kernel
is asked for (or at :func:`pdserve.kernels.prepare_cpu`), :func:`chosen` times it and the
reference on a small probe of the embedded model's shape, best of a few interleaved runs,
and logs one line (``cpu_kernel_choice``: ISA, kernel, both timings, the choice).
``PDSERVE_KERNELS=torch`` uses the reference only (the oracle the tests compare these
kernels with).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SOURCES = tuple(Path(__file__).with_name(n) for n in ("cpu_attention.cpp", "cpu_pointwise.cpp"))
COMMON_CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
ISA_ENV = "PDSERVE_CPU_ISA"
# best first: (compiler flags, the /proc/cpuinfo flags a CPU needs to run that build);
# x86-64-v4 is v3 plus AVX512F/BW/CD/DQ/VL, v3 is AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE
_V3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "xsave"}
ISAS: dict[str, tuple[list[str], set[str]]] = {
    "avx512": (["-march=x86-64-v4", "-mtune=generic"], _V3 | {"avx512f", "avx512bw", "avx512cd",
                                                              "avx512dq", "avx512vl"}),
    "avx2": (["-march=x86-64-v3", "-mtune=generic"], _V3),
    "portable": (["-march=x86-64", "-mtune=generic"], set()),
}  # fmt: skip
# the ISA tag each build's library reports (the compiled #if branch)
ISA_TAGS = {"avx512": "avx512", "avx2": "avx2", "portable": "sse"}
KERNELS = ("paged_decode", "paged_prefill", "rms_norm", "rotary", "silu_and_mul")


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cflags(isa: str) -> list[str]:
    """The compiler flags of one ISA's build (no -march off x86: the compiler's default)."""
    return COMMON_CFLAGS + (ISAS[isa][0] if _x86() else [])


def supported_isas() -> list[str]:
    """The builds this CPU runs, best first (off x86: the portable one alone)."""
    if not _x86():
        return ["portable"]
    flags = _cpu_flags()
    return [isa for isa, (_, needs) in ISAS.items() if needs <= flags]


def _wanted_isas() -> list[str]:
    """The builds to try, in order: the forced one (PDSERVE_CPU_ISA) if the CPU runs it,
    else every one it runs, best first."""
    supported = supported_isas()
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced and forced != "auto":
        if forced not in ISAS:
            raise ValueError(f"{ISA_ENV}={forced!r}: expected auto or one of {', '.join(ISAS)}")
        if forced not in supported:
            raise ValueError(
                f"{ISA_ENV}={forced}: this CPU cannot run that build (it runs "
                f"{', '.join(supported)})"
            )
        return [forced]
    return supported


def _name(isa: str) -> str:
    key = "\n".join(
        [
            *(s.read_text() for s in SOURCES),
            " ".join(cflags(isa) + LDFLAGS),
            platform.machine(),
            torch.__version__,
        ]
    )
    return f"pdserve_cpu_{isa}_" + hashlib.sha256(key.encode()).hexdigest()[:16]


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


def _load_or_build(name: str, flags: list[str] | None = None) -> Any:
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
                    extra_cflags=flags if flags is not None else COMMON_CFLAGS,
                    extra_ldflags=LDFLAGS,
                    build_directory=str(folder),
                )
                (folder / "built").write_text(str(library) + "\n")
                return module
    return _import(library, name)


def _log() -> Any:
    import structlog  # here: the kernels import with torch alone

    return structlog.get_logger("pdserve.kernels")


@functools.cache
def load_isa(isa: str) -> Any:
    """One ISA's build of the module (built on first use, once per machine), checked to
    report that ISA; raises where it cannot be built. The caller checks the CPU runs it."""
    name = _name(isa)
    module = _load_or_build(name, cflags(isa))
    tag = module.isa()
    if _x86() and tag != ISA_TAGS[isa]:
        raise RuntimeError(f"the {isa} build reports ISA {tag!r}: its flags did not apply")
    return module


@functools.cache
def load() -> Any | None:
    """The compiled module of the best ISA this CPU runs (or PDSERVE_CPU_ISA's), built on
    first use; None (and the reason logged once) when none can be built here."""
    log = _log()
    reasons = []
    try:
        isas = _wanted_isas()
    except ValueError as exc:
        log.warning("cpu_attention_kernel_unavailable", reason=str(exc),
                    fallback="torch reference (gather + SDPA)")  # fmt: skip
        return None
    for isa in isas:
        try:
            module = load_isa(isa)
        except Exception as exc:  # no compiler, no ninja, no Python headers, an old compiler
            lines = str(exc).strip().splitlines() or [""]
            reasons.append(f"{isa}: {type(exc).__name__}: {lines[-1][:300]}")
            continue
        log.info("cpu_attention_kernel_loaded", name=_name(isa), isa=isa,
                 not_built="; ".join(reasons) or None)  # fmt: skip
        return module
    log.warning("cpu_attention_kernel_unavailable", reason="; ".join(reasons),
                fallback="torch reference (gather + SDPA)")  # fmt: skip
    return None


def loaded_isa() -> str | None:
    """The ISA of the build in use ("avx512", "avx2", "portable"), None where none is."""
    module = load()
    if module is None:
        return None
    tag = module.isa()
    return next((isa for isa, t in ISA_TAGS.items() if t == tag), tag)


def describe() -> dict[str, Any]:
    """For a results JSON: the CPU's flags, the build in use and each kernel's choice so
    far."""
    flags = _cpu_flags()
    return {
        "cpu_model": _cpu_model(),
        "cpu_flags": " ".join(sorted(flags)),
        "cpu_isas": supported_isas(),
        "native_isa": loaded_isa(),
        "native_choices": dict(_choices),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# --- the chooser: a kernel is used only where it beats the reference here ---------------

_choices: dict[str, dict[str, Any]] = {}
_choosing = threading.Lock()


def _probe(kernel: str, module: Any) -> tuple[Callable[[], object], Callable[[], object]]:
    """(compiled call, reference call) of one kernel on a small problem of the embedded
    model's shape (9 query heads, 3 KV heads, head_dim 64, hidden 576, intermediate 1536)."""
    from pdserve.kernels import pointwise_ref, reference

    gen = torch.Generator().manual_seed(0)
    h_q, h_kv, d, block = 9, 3, 64, 64
    if kernel in ("paged_decode", "paged_prefill"):
        seqs, ctx = (16, 256) if kernel == "paged_decode" else (1, 256)
        nblk = seqs * ctx // block
        cache = torch.randn(nblk, 2, h_kv, block, d, generator=gen)
        tables = torch.arange(nblk, dtype=torch.int32).reshape(seqs, ctx // block)
        lens = torch.full((seqs,), ctx, dtype=torch.int32)
        if kernel == "paged_decode":
            q = torch.randn(seqs, h_q, d, generator=gen)
            dargs = (q, cache, lens, tables, d**-0.5)
            return (lambda: module.paged_decode(*dargs, 0),
                    lambda: reference.decode_attention(*dargs))  # fmt: skip
        q = torch.randn(seqs * ctx, h_q, d, generator=gen)
        cu = torch.tensor([0, seqs * ctx], dtype=torch.int32)
        pargs = (q, cache, cu, lens, tables, d**-0.5)
        return (lambda: module.paged_prefill(*pargs, 0),
                lambda: reference.prefill_attention(*pargs))  # fmt: skip
    rows = 64
    if kernel == "rms_norm":
        x, res = torch.randn(2, rows, 576, generator=gen)
        w = torch.randn(576, generator=gen)
        return (lambda: module.rms_norm(x, w, 1e-5, res),
                lambda: pointwise_ref.rms_norm(x, w, 1e-5, res))  # fmt: skip
    if kernel == "rotary":
        qkv = torch.randn(rows, h_q + 2 * h_kv, d, generator=gen)
        q, k = qkv[:, :h_q], qkv[:, h_q : h_q + h_kv]
        cos, sin = torch.randn(2, rows, d, generator=gen)
        return (lambda: module.rotary(q, k, cos, sin),
                lambda: pointwise_ref.rotary(q, k, cos, sin))  # fmt: skip
    if kernel == "silu_and_mul":
        gate_up = torch.randn(rows, 2 * 1536, generator=gen)
        return (lambda: module.silu_and_mul(gate_up),
                lambda: pointwise_ref.silu_and_mul(gate_up))  # fmt: skip
    raise ValueError(f"no probe for kernel {kernel!r}")


def measure(kernel: str, module: Any, repeats: int = 5) -> tuple[float, float]:
    """(compiled ms, reference ms) of ``kernel`` on its probe: the best of ``repeats``
    interleaved runs each, after one warm-up (the best: other processes on a shared machine
    only ever add time). Tests replace this function to inject timings."""
    native, ref = _probe(kernel, module)
    best = [float("inf"), float("inf")]
    for i in range(repeats + 1):
        for j, fn in enumerate((native, ref)):
            start = time.perf_counter()
            fn()
            if i:
                best[j] = min(best[j], (time.perf_counter() - start) * 1e3)
    return best[0], best[1]


def chosen(kernel: str) -> bool:
    """Whether ``kernel``'s compiled version serves on this machine: it is built and, on its
    probe, faster than the reference. Decided once per process, logged."""
    if kernel in _choices:
        return bool(_choices[kernel]["compiled"])
    with _choosing:
        if kernel in _choices:
            return bool(_choices[kernel]["compiled"])
        return _choose(kernel)


def _choose(kernel: str) -> bool:
    module = load()
    if module is None:
        _choices[kernel] = {"compiled": False, "error": "not built"}
        return False
    try:
        native_ms, ref_ms = measure(kernel, module)
    except Exception as exc:  # a probe that fails here: the reference serves
        _log().warning("cpu_kernel_choice", isa=loaded_isa(), kernel=kernel,
                       error=f"{type(exc).__name__}: {exc}", chosen="reference")  # fmt: skip
        _choices[kernel] = {"compiled": False, "error": str(exc)}
        return False
    use = native_ms < ref_ms
    _choices[kernel] = {"compiled": use, "compiled_ms": round(native_ms, 4),
                        "reference_ms": round(ref_ms, 4)}  # fmt: skip
    _log().info("cpu_kernel_choice", isa=loaded_isa(), kernel=kernel,
                compiled_ms=round(native_ms, 4), reference_ms=round(ref_ms, 4),
                chosen="compiled" if use else "reference")  # fmt: skip
    return use


def reset_choices() -> None:
    """Forget the choices (tests)."""
    _choices.clear()


def decode_attention(
    q: torch.Tensor,  # [S, H_q, D]
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D]
    context_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_blocks]
    scale: float,
    sliding_window: int | None,
    module: Any = None,
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
    module = module or load()
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
    module: Any = None,
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
    module = module or load()
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
    module: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight * normalise(x + residual), x + residual) in one pass, or None where the
    compiled op does not apply (not float32 rows on CPU) or is not built."""
    extra = () if residual is None else (residual,)
    if x.dim() != 2 or not _rows_ok(x, weight, *extra) or not weight.is_contiguous():
        return None
    module = module or load()
    if module is None:
        return None
    outs = module.rms_norm(x, weight, eps, residual)
    return outs[0], (outs[1] if residual is not None else None)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, module: Any = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q and k rotated in place (views into one qkv row are fine), or None where the compiled
    op does not apply or is not built."""
    if q.dim() != 3 or not _rows_ok(q, k) or cos.dtype != torch.float32:
        return None
    module = module or load()
    if module is None:
        return None
    module.rotary(q, k, cos, sin)
    return q, k


def silu_and_mul(gate_up: torch.Tensor, module: Any = None) -> torch.Tensor | None:
    """silu(gate) * up in one pass, or None where the compiled op does not apply or is not
    built."""
    if gate_up.dim() != 2 or not _rows_ok(gate_up):
        return None
    module = module or load()
    if module is None:
        return None
    out: torch.Tensor = module.silu_and_mul(gate_up)
    return out

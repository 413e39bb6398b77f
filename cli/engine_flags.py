"""Engine flags that several subcommands share (stdlib only at import time)."""

from __future__ import annotations

import argparse

# The values of [engine] kv_cache_dtype (common/engine/config.py KV_CACHE_DTYPES); repeated
# here so that building the parser imports nothing of the engine.
KV_CACHE_DTYPES = ("auto", "fp8")


def add_kv_cache_dtype(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=default,
        help="KV cache storage: auto (the model dtype) or fp8 (float8 e4m3, per-tensor scale; "
        "half the bytes of bf16; MLA models: the fp8_ds_mla latent, 656 bytes a token and "
        "layer). Default: [engine] kv_cache_dtype, else auto",
    )


def _gpu_share(text: str) -> object:
    from pdserve.cli.gpu_share import parse_gpu_share

    try:
        return parse_gpu_share(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_gpu_share(p: argparse.ArgumentParser) -> None:
    """``--gpu-share`` (cli/gpu_share.py): prefill and decode on one GPU under CUDA MPS."""
    p.add_argument(
        "--gpu-share",
        type=_gpu_share,
        default="auto",
        metavar="auto|off|prefill=P,decode=D",
        help="prefill and decode processes on one GPU: auto (default) runs them under CUDA "
        "MPS, concurrently on the SMs (a running MPS control daemon, else one started and "
        "stopped with the deployment); prefill=P,decode=D also holds each role to P / D "
        "percent of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); off: time-sliced",
    )

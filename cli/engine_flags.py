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

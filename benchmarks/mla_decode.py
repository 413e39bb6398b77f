"""The Triton MLA decode kernel (kernels/triton_mla.py) alone at DeepSeek-V3's attention
shape, auto (bf16 latent) against fp8_ds_mla (656-byte records) caches, on one GPU.

    python benchmarks/mla_decode.py                       # batch 1,64, context 2048
    python benchmarks/mla_decode.py --sweep               # also triton_mla.SWEEP_TILES
    TRITON_INTERPRET=1 python benchmarks/mla_decode.py --device cpu --heads 4 --latent 128 \
        --rope 16 --context 40 --batch-sizes 2 --block-size 16     # a smoke run, no GPU

Per (cache, batch): the kernel's time (triton.testing.do_bench, median), the bytes of
latent it must read (batch x context x bytes a token) over that time, and the largest
difference from the torch reference over the same cache (relative to its largest value).
``--sweep`` overrides ``triton_mla.decode_tile`` to time, beside the default, each candidate
tile of ``triton_mla.SWEEP_TILES`` for the batch's regime (BLOCK_H heads a program, BLOCK_N
keys a tile, warps, pipeline stages, and the splits that ``waves`` x SMs programs give),
then prints the fastest of each (cache, regime) whose error is within 1e-2, as the
``DECODE_TILES`` entries to set in kernels/triton_mla.py. On CUDA ``--jobs`` processes first
compile every variant (one launch each at a short context, into Triton's on-disk cache);
sweep candidates past ``--budget-s`` (75) seconds are skipped (the defaults never are), so
the default sweep (batch 1 and 64, 24 variants) stays within 90 s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import multiprocessing
import statistics
import time
from collections.abc import Callable

import torch


def _bench(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call: do_bench's median on a GPU, the median of 3 elsewhere."""
    if device.type == "cuda":
        import triton

        return float(triton.testing.do_bench(fn, return_mode="median"))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _fix_interpreter() -> None:
    """Triton 3.6's interpreter vs numpy >= 2.4 (tests/test_mla_kernels.py)."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


def _compile(job: tuple[int, str, object, int, int, int, int, int, int, str, str]) -> str:
    """In a worker process: one launch of a variant at a short context (the same arguments'
    types, strides and alignment as the timed one), so Triton's on-disk cache holds its
    kernels when the main process times it; '' or the error."""
    from pdserve.kernels import fp8_ds_mla, triton_mla

    batch, cache_kind, tile, splits, heads, latent, rope, block, context, dtype_name, device = job
    dtype, dev = getattr(torch, dtype_name), torch.device(device)
    if dev.type == "cpu":
        _fix_interpreter()
    triton_mla.decode_tile = lambda *_: tile  # type: ignore[assignment,misc]
    per_seq = -(-context // block)  # the table's stride as in the timed run
    width = fp8_ds_mla.record_bytes(latent, rope) if cache_kind == "fp8" else latent + rope
    cache = torch.zeros((batch * per_seq, 1, 1, block, width), device=dev,
                        dtype=torch.uint8 if cache_kind == "fp8" else dtype)  # fmt: skip
    tables = torch.arange(batch * per_seq, device=dev, dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), block, dtype=torch.int32, device=dev)
    q = torch.zeros(batch, heads, latent + rope, device=dev, dtype=dtype)
    try:
        triton_mla.mla_decode_attention(q, cache, lens, tables, 0.1, latent, splits)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported by the timed run too
        return repr(e)
    return ""


def main() -> None:
    from pdserve.kernels import fp8_ds_mla, mla_reference, triton_mla

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: under TRITON_INTERPRET=1 only")
    ap.add_argument("--jobs", type=int, help="processes compiling the variants first (CUDA: 8)")
    ap.add_argument("--budget-s", type=float, default=75.0,
                    help="sweep candidates past this many seconds are skipped")  # fmt: skip
    args = ap.parse_args()
    started = time.perf_counter()
    dtype, dev, block = getattr(torch, args.dtype), torch.device(args.device), args.block_size
    width = args.latent + args.rope
    torch.manual_seed(0)
    if dev.type == "cpu":
        _fix_interpreter()
    tile_of = triton_mla.decode_tile
    print(f"heads {args.heads}  latent {args.latent}  rope {args.rope}  context {args.context}  "
          f"{args.dtype}  {args.device}")  # fmt: skip
    print("cache  batch  BLOCK_H  BLOCK_N  warps  stages  waves  lazy  splits  us  GB/s  "
          "max |diff| / max |ref|")  # fmt: skip
    best: dict[tuple[str, str], tuple[float, triton_mla.DecodeTile]] = {}
    batches = [int(b) for b in args.batch_sizes.split(",")]

    def variants(batch: int, cache_dtype: str) -> list[triton_mla.DecodeTile]:
        ds = cache_dtype == "fp8"
        configs = [tile_of(ds, dtype, block, batch)]
        if args.sweep:
            configs += [
                dataclasses.replace(t, block_n=min(t.block_n, block))
                for t in triton_mla.SWEEP_TILES[(cache_dtype, triton_mla.decode_regime(batch))]
            ]
        return list(dict.fromkeys(configs))

    if (
        8 if dev.type == "cuda" and args.jobs is None else args.jobs or 1
    ) > 1:  # compile every variant at once, in processes
        jobs = []
        for batch in batches:
            for cache_dtype in ("auto", "fp8"):
                for tile in variants(batch, cache_dtype):
                    triton_mla.decode_tile = lambda *_, t=tile: t  # type: ignore[misc]
                    splits = triton_mla.mla_decode_splits(
                        batch, args.heads, dev, cache_dtype == "fp8"
                    )
                    triton_mla.decode_tile = tile_of
                    jobs.append((batch, cache_dtype, tile, splits, args.heads, args.latent,
                                 args.rope, block, args.context, args.dtype, args.device))  # fmt: skip
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs or 8, mp_context=spawn) as pool:
            failed = sum(bool(e) for e in pool.map(_compile, jobs))
        print(f"compiled {len(jobs)} variants in {time.perf_counter() - started:.0f} s "
              f"({failed} failed)")  # fmt: skip
    for batch in batches:
        per_seq = -(-args.context // block)
        tables = torch.randperm(batch * per_seq, device=dev, dtype=torch.int32).view(batch, -1)
        lens = torch.full((batch,), args.context, dtype=torch.int32, device=dev)
        pos = torch.arange(args.context, device=dev)
        slots = (tables[:, pos // block].long() * block + pos % block).flatten()
        rows = torch.randn(batch * args.context, width, device=dev, dtype=dtype)
        q = torch.randn(batch, args.heads, width, device=dev, dtype=dtype) * 0.1
        scale = (128 + args.rope) ** -0.5
        regime = triton_mla.decode_regime(batch)
        for cache_dtype in ("auto", "fp8"):
            if cache_dtype == "fp8":
                record = fp8_ds_mla.record_bytes(args.latent, args.rope)
                cache = torch.zeros((batch * per_seq, 1, 1, block, record), dtype=torch.uint8)
                token_bytes = record
            else:
                cache = torch.zeros((batch * per_seq, 1, 1, block, width), dtype=dtype)
                token_bytes = width * cache.element_size()
            cache = cache.to(dev)
            triton_mla.write_latent(cache, rows, slots, args.latent)
            want = mla_reference.mla_decode_attention(
                q.float(), cache if cache_dtype == "fp8" else cache.float(), lens, tables,
                scale, args.latent,
            )  # fmt: skip
            ds = cache_dtype == "fp8"
            for i, tile in enumerate(variants(batch, cache_dtype)):
                triton_mla.decode_tile = lambda *_, t=tile: t  # type: ignore[misc]
                head = (f"{cache_dtype:5s}  {batch:5d}  {tile.block_h:7d}  {tile.block_n:7d}  "
                        f"{tile.num_warps:5d}  {tile.num_stages:6d}  {tile.waves:5.1f}  "
                        f"{'lazy' if tile.lazy else '-':4s}")  # fmt: skip
                if i and time.perf_counter() - started > args.budget_s:
                    print(f"{head}  skipped: past --budget-s {args.budget_s:.0f}")
                    continue
                try:
                    splits = triton_mla.mla_decode_splits(batch, args.heads, dev, ds)
                    out = triton_mla.mla_decode_attention(
                        q, cache, lens, tables, scale, args.latent
                    )
                    run = functools.partial(
                        triton_mla.mla_decode_attention, q, cache, lens, tables, scale, args.latent
                    )
                    ms = _bench(run, dev)
                except Exception as e:  # noqa: BLE001 - a config over the GPU's resources
                    print(f"{head}  {e!r:.80}")
                    continue
                finally:
                    triton_mla.decode_tile = tile_of
                diff = float((out.float() - want).abs().max() / want.abs().max())
                gbps = batch * args.context * token_bytes / (ms * 1e-3) / 1e9
                print(f"{head}  {splits:6d}  {ms * 1e3:8.1f}  {gbps:6.0f}  {diff:.1e}")
                key = (cache_dtype, regime)
                if diff < 1e-2 and (key not in best or ms < best[key][0]):
                    best[key] = (ms, tile)
    if args.sweep:
        print("fastest (set in kernels/triton_mla.py):")
        print("DECODE_TILES = {")
        for (cache_dtype, regime), (ms, tile) in sorted(best.items()):
            t = tile
            print(f'    ("{cache_dtype}", "{regime}"): DecodeTile({t.block_h}, {t.block_n}, '
                  f"{t.num_warps}, {t.num_stages}, {t.waves}{', lazy=True' if t.lazy else ''}),  "
                  f"# {ms * 1e3:.1f} us")  # fmt: skip
        print("}")
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

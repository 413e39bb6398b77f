"""GPU prefill attention of one layer over the paged cache (kernels/triton_ops.py), against
torch's scaled_dot_product_attention on contiguous K/V (its flash and cuDNN backends, where
they run) as the reference rate, at the 8B shape (32 query heads, 8 KV heads, head_dim 128).

    python benchmarks/gpu_prefill_attention.py [--cases 1x2048,4x2048,1x8192,chunk]
        [--heads 32,8,128] [--configs 128x8x2,64x4x2] [--baseline FILE] [--json F]

``--configs`` times the kernel at other launch shapes too (rows x warps x stages, see
kernels/triton_prefill.py PrefillConfig); ``--baseline`` another version of
kernels/triton_ops.py (e.g. ``git show REV:kernels/triton_ops.py > FILE``), in the same run.

A case ``NxL`` is N whole prompts of L tokens; ``chunk`` is 512 new tokens after 1,536
cached ones. TFLOP/s counts the causal half of QK^T and PV (4 * q_len * keys seen * D * H_q),
the same for every column; the SDPA columns see only the new tokens' causal square (for
``chunk`` that is less work, so its rate is the one comparable figure). Times are the median
of --repeats CUDA-event timings.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pdserve.cli.provenance import provenance
from pdserve.kernels import triton_ops, triton_prefill


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def seqs_of(case: str) -> list[tuple[int, int]]:
    """(context, new tokens) per sequence."""
    if case == "chunk":
        return [(2048, 512)]
    n, length = map(int, case.split("x"))
    return [(length, length)] * n


def load_baseline(path: str):  # noqa: ANN201 - a module
    spec = importlib.util.spec_from_file_location("pdserve.kernels._baseline_triton_ops", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure_case(
    case: str,
    heads: tuple[int, int, int],
    block: int,
    repeats: int,
    gen: torch.Generator,
    configs: list[triton_prefill.PrefillConfig],
    baseline,  # noqa: ANN001 - a module with prefill_attention, or None
) -> dict:
    num_heads, num_kv_heads, head_dim = heads
    scale, dev = head_dim**-0.5, torch.device("cuda")
    seqs = seqs_of(case)
    blocks = [-(-ctx // block) for ctx, _ in seqs]
    num_blocks = sum(blocks) + 1
    shape = (num_blocks, 2, num_kv_heads, block, head_dim)
    cache = torch.randn(*shape, generator=gen, device=dev, dtype=torch.bfloat16)
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32, device=dev)
    ids = (torch.randperm(num_blocks - 1, device=dev, generator=gen) + 1).tolist()
    for s, n in enumerate(blocks):
        tables[s, :n] = torch.tensor(ids[:n])
        del ids[:n]
    lens = torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32, device=dev)
    q_lens = torch.tensor([n for _, n in seqs], device=dev)
    cu = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), q_lens.cumsum(0)]).int()
    total = int(q_lens.sum())
    q = torch.randn(total, num_heads, head_dim, generator=gen, device=dev).bfloat16()
    pairs = sum(n * (ctx - n) + n * (n + 1) // 2 for ctx, n in seqs)
    tflop = 4 * pairs * head_dim * num_heads / 1e12

    def ours() -> torch.Tensor:
        return triton_ops.prefill_attention(q, cache, cu, lens, tables, scale)

    row = {"case": case, "tokens": total, "ours_ms": median_ms(ours, repeats)}
    out = torch.empty_like(q)
    for c in configs:

        def tuned(c: triton_prefill.PrefillConfig = c) -> None:
            triton_prefill._prefill_into(out, q, cache, cu, lens, tables, scale, None, config=c)

        row[f"cfg_{c.rows}x{c.num_warps}x{c.num_stages}_ms"] = median_ms(tuned, repeats)
    if baseline is not None:

        def before() -> torch.Tensor:
            return baseline.prefill_attention(q, cache, cu, lens, tables, scale)

        row["baseline_ms"] = median_ms(before, repeats)
    # the reference: each sequence's own keys gathered once into [1, H, L, D] tensors
    kv = []
    for s, (ctx, _n) in enumerate(seqs):
        ids_s = tables[s, : blocks[s]].long()
        k = cache[ids_s, 0].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :ctx]
        v = cache[ids_s, 1].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :ctx]
        kv.append((k[None].contiguous(), v[None].contiguous()))
    qs = [
        q[int(cu[s]) : int(cu[s + 1])].transpose(0, 1)[None].contiguous() for s in range(len(seqs))
    ]
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):  # fmt: skip

        def sdpa(backend: SDPBackend = backend) -> list[torch.Tensor]:
            with sdpa_kernel(backend):
                return [
                    F.scaled_dot_product_attention(
                        qq,
                        k[..., -qq.shape[2] :, :],
                        v[..., -qq.shape[2] :, :],
                        is_causal=True,
                        enable_gqa=True,
                        scale=scale,
                    )  # fmt: skip
                    for qq, (k, v) in zip(qs, kv, strict=True)
                ]

        try:
            row[f"sdpa_{name}_ms"] = median_ms(sdpa, repeats)
        except RuntimeError as exc:  # a backend that does not take this shape
            row[f"sdpa_{name}_ms"] = None
            print(f"{case}: SDPA {name}: {str(exc).splitlines()[0][:120]}")
    if case != "chunk":  # same work: check the output against flash's
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = torch.cat(
                [
                    F.scaled_dot_product_attention(
                        qq, k, v, is_causal=True, enable_gqa=True, scale=scale
                    )[0].transpose(0, 1)
                    for qq, (k, v) in zip(qs, kv, strict=True)
                ]
            )
        row["max_abs_err"] = float((ours().float() - ref.float()).abs().max())
    for key in [k for k in row if k.endswith("_ms")]:
        ms = row[key]
        row[key.replace("_ms", "_tflops")] = None if ms is None else tflop / (ms / 1e3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cases", default="1x2048,4x2048,1x8192,chunk")
    ap.add_argument("--heads", default="32,8,128", help="H_q,H_kv,D (default: Llama-3-8B)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--configs", default="", help="e.g. 128x8x2,64x4x3 (rows x warps x stages)")
    ap.add_argument("--baseline", default=None, help="another kernels/triton_ops.py to time")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    configs = [
        triton_prefill.PrefillConfig(*map(int, c.split("x"))) for c in args.configs.split(",") if c
    ]
    baseline = load_baseline(args.baseline) if args.baseline else None
    num_heads, num_kv_heads, head_dim = map(int, args.heads.split(","))
    block = args.block_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for case in args.cases.split(","):
        heads = (num_heads, num_kv_heads, head_dim)
        row = measure_case(case, heads, block, args.repeats, gen, configs, baseline)
        rows.append(row)
        cols = [
            f"{key[:-3]} {row[key]:.3f} ms {row[key[:-3] + '_tflops']:.0f} TF/s"
            for key in row
            if key.endswith("_ms") and row[key] is not None
        ]
        err = f" | err {row['max_abs_err']:.2e}" if "max_abs_err" in row else ""
        print(f"{case:8s} " + " | ".join(cols) + err)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": provenance(), "heads": args.heads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""MLA prefill of one attention layer: ours (common/model/layers/mla.py on a paged latent cache)
against transformers' ``DeepseekV3Attention`` (SDPA) with the same weights and rope.

    python benchmarks/mla_prefill.py --device cpu --dtype float32            # dsv3-mini sizes
    python benchmarks/mla_prefill.py --device cuda --dtype bfloat16 --hidden 7168 \\
        --heads 128 --q-lora 1536 --seqs 1,16 --tokens 2048                     # DeepSeek-V3's

Per batch: the median time of a prefill of ``seqs`` prompts of ``tokens`` tokens (ours:
write the latent rows, expand, attend, o_proj; HF: the same layer on ``[seqs, tokens]``),
their ratio, and the largest difference of the outputs relative to HF's largest value
(a check that both computed the same thing).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch


def _timed(fn: Callable[[], torch.Tensor], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from pdserve.common.model.checkpoint.config import ModelConfig
    from pdserve.common.model.fixtures.random import DSV3_ROPE
    from pdserve.common.model.layers.attention import AttentionMetadata
    from pdserve.common.model.layers.mla import MLAAttention
    from pdserve.common.model.layers.rope import RotaryEmbedding
    from pdserve.common.parallel.context import ParallelContext
    from pdserve.kernels import fp8_ds_mla

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--q-lora", type=int, default=384)
    ap.add_argument("--kv-lora", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--nope", type=int, default=128)
    ap.add_argument("--v", type=int, default=128)
    ap.add_argument("--seqs", default="1,2", help="batch sizes, comma-separated")
    ap.add_argument("--tokens", type=int, default=1024, help="prompt length")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)

    config = DeepseekV3Config(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=256,
        num_hidden_layers=1,
        first_k_dense_replace=1,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        q_lora_rank=args.q_lora,
        kv_lora_rank=args.kv_lora,
        qk_rope_head_dim=args.rope,
        qk_nope_head_dim=args.nope,
        v_head_dim=args.v,
        rope_scaling=DSV3_ROPE,
        max_position_embeddings=163840,  # yarn: 40 x 4096
    )
    config._attn_implementation = "sdpa"
    theirs = hf.DeepseekV3Attention(config, layer_idx=0).to(device, dtype).eval()
    cfg = ModelConfig.from_dict(config.to_dict())
    ours = MLAAttention(cfg, ParallelContext(), 0).to(device, dtype).eval()
    ours.load_state_dict(theirs.state_dict())
    hf_rope = hf.DeepseekV3RotaryEmbedding(config).to(device)
    our_rope = RotaryEmbedding(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
    ).to(device)

    block = 64
    width = args.kv_lora + args.rope
    print(
        f"hidden {args.hidden}  heads {args.heads}  kv_lora {args.kv_lora}  rope {args.rope}  "
        f"nope {args.nope}  v {args.v}  tokens {args.tokens}  {args.dtype} on {args.device}  "
        f"kv cache {args.kv_cache_dtype}  threads {torch.get_num_threads()}"
    )
    print("seqs  ours ms  HF ms  ours/HF speed  max |diff| / max |HF|")
    for seqs in [int(s) for s in args.seqs.split(",")]:
        per_seq = -(-args.tokens // block)
        n = seqs * per_seq
        if args.kv_cache_dtype == "fp8":
            record = fp8_ds_mla.record_bytes(args.kv_lora, args.rope)
            cache = torch.zeros((n, 1, 1, block, record), dtype=torch.uint8, device=device)
        else:
            cache = torch.zeros((n, 1, 1, block, width), dtype=dtype, device=device)
        tables = torch.arange(n, dtype=torch.int32, device=device).view(seqs, per_seq)
        pos = torch.arange(args.tokens, device=device)
        slots = (tables[:, pos // block].long() * block + pos % block).flatten()
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=0,
            decode_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
            decode_block_tables=torch.zeros((0, 1), dtype=torch.int32, device=device),
            prefill_cu_seqlens_q=torch.arange(seqs + 1, dtype=torch.int32, device=device)
            * args.tokens,
            prefill_context_lens=torch.full((seqs,), args.tokens, dtype=torch.int32, device=device),
            prefill_block_tables=tables,
        )
        x = torch.randn(seqs, args.tokens, args.hidden, device=device, dtype=dtype)
        cos, sin = our_rope.cos_sin(pos.repeat(seqs))
        rope = (cos.to(dtype), sin.to(dtype))
        hf_cos_sin = hf_rope(x, pos[None].expand(seqs, -1))

        with torch.inference_mode():
            run_ours = functools.partial(ours, x.flatten(0, 1), rope, cache, meta)

            def run_hf(x: torch.Tensor = x, cos_sin: tuple = hf_cos_sin) -> torch.Tensor:
                return theirs(x, cos_sin, None)[0]

            t_ours = _timed(run_ours, args.repeats, sync)
            t_hf = _timed(run_hf, args.repeats, sync)
            a, b = run_ours().float(), run_hf().flatten(0, 1).float()
            diff = float((a - b).abs().max() / b.abs().max())
        print(
            f"{seqs:4d}  {t_ours * 1e3:7.1f}  {t_hf * 1e3:5.1f}  {t_hf / t_ours:13.2f}x  {diff:.1e}"
        )


if __name__ == "__main__":
    main()

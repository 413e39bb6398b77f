"""MLA prefill: the cached latent of the prefill sequences expanded into per-head K and V,
then causal attention per sequence.

* Gather and expansion are batched: the latent rows of every sequence of a group are
  gathered with one index (fp8_ds_mla records dequantized in the same pass) and expanded by
  one ``kv_b_proj`` matmul, for groups of at most ``EXPAND_TOKENS`` context tokens (bounding
  the expanded K/V at long batches: 8k tokens x 128 heads x (192 + 192) x 2 bytes = 0.8 GB).
* Attention: one ``scaled_dot_product_attention`` per sequence, or per run of sequences of
  one length without a cached prefix, on 4-D ``[n, H, len, D]`` views. SDPA's fused kernels
  refuse 3-D inputs and fall back to the math path, which materialises every ``[H, len,
  len]`` score matrix (the old per-sequence 3-D calls did: the H200's prefill at 0.2x of
  transformers', which passes 4-D). The value is zero-padded to the query/key width
  (DeepSeek: 128 -> 192; not on CUDA in fp32, which has no flash kernel: ``pads_value``)
  since flash attention needs one head dim for q, k and v; the padding's output columns are
  zeros and are dropped. A sequence with a cached prefix (its queries the last ``q_len`` of
  ``ctx`` positions) takes the lower-right causal mask, which flash attention also runs.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pdserve.common.model.layers.attention import AttentionMetadata
from pdserve.kernels import fp8_ds_mla

EXPAND_TOKENS = 8192  # context tokens expanded into per-head K/V by one matmul


def gather_rows(
    layer_cache: torch.Tensor,  # [N, 1, 1, B, D] (fp8_ds_mla: [N, 1, 1, B, record] uint8)
    block_tables: torch.Tensor,  # [S, max_blocks] int
    context_lens: list[int],  # [S]
    latent_dim: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [sum(context_lens), latent_dim + rope] in dtype
    """The cached latent rows of positions 0 .. ctx - 1 of each sequence, concatenated."""
    block_size = layer_cache.shape[3]
    device = layer_cache.device
    lens = torch.tensor(context_lens, device=device)
    total = sum(context_lens)
    seq = torch.repeat_interleave(
        torch.arange(len(context_lens), device=device), lens, output_size=total
    )
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(total, device=device) - starts[seq]
    blocks = block_tables.to(device)[seq, pos // block_size].long()
    rows = layer_cache[blocks, 0, 0, pos % block_size]  # [total, D]
    if fp8_ds_mla.is_ds_mla(layer_cache.dtype):
        return fp8_ds_mla.dequantize_rows(rows, latent_dim, dtype)
    return rows.to(dtype)


def _groups(context_lens: list[int]) -> list[tuple[int, int]]:
    """Runs [a, b) of sequences, each of at most EXPAND_TOKENS context tokens (or one
    sequence longer than that)."""
    runs, start, tokens = [], 0, 0
    for s, n in enumerate(context_lens):
        if tokens and tokens + n > EXPAND_TOKENS:
            runs.append((start, s))
            start, tokens = s, 0
        tokens += n
    runs.append((start, len(context_lens)))
    return runs


def pads_value(q: torch.Tensor) -> bool:
    """Whether q, k and v take one head dim (the widest), for flash attention. Not on CUDA
    in fp32, which has no flash kernel and runs for exactness (the GPU tests' greedy
    identity with transformers' fp32 on CPU): SDPA's math path there, as before, on
    unpadded 4-D views."""
    return q.device.type != "cuda" or q.dtype != torch.float32


def mla_prefill(
    q_nope: torch.Tensor,  # [T_p, H, nope]
    q_rope: torch.Tensor,  # [T_p, H, rope]
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_b_proj: torch.nn.Linear,  # latent -> H x (nope + v)
    latent_dim: int,
    v_dim: int,
    scale: float,
) -> torch.Tensor:  # [T_p, H, v]
    num_tokens, heads, nope = q_nope.shape
    qk = nope + q_rope.shape[-1]
    pad = pads_value(q_nope)
    width = max(qk, v_dim) if pad else qk
    out = torch.empty((num_tokens, heads, v_dim), dtype=q_nope.dtype, device=q_nope.device)
    starts = meta.prefill_cu_seqlens_q.tolist()
    context_lens = meta.prefill_context_lens.tolist()
    q = torch.cat((q_nope, q_rope), dim=-1)  # [T_p, H, qk]
    if width > qk:
        q = F.pad(q, (0, width - qk))
    with contextlib.nullcontext() if pad else sdpa_kernel(SDPBackend.MATH):
        for a, b in _groups(context_lens):
            rows = gather_rows(
                layer_cache, meta.prefill_block_tables[a:b], context_lens[a:b], latent_dim, q.dtype
            )  # [n, latent + rope]
            kv = kv_b_proj(rows[:, :latent_dim]).view(-1, heads, nope + v_dim)
            k_nope, v = kv.split([nope, v_dim], dim=-1)
            k = torch.cat((k_nope, rows[:, None, latent_dim:].expand(-1, heads, -1)), dim=-1)
            if width > qk:
                k = F.pad(k, (0, width - qk))
            if pad and width > v_dim:
                v = F.pad(v, (0, width - v_dim))
            _attend_group(q, k, v, out, starts, context_lens, a, b, scale)
    return out


def _attend_group(
    q: torch.Tensor,  # [T_p, H, width]
    k: torch.Tensor,  # [sum of the group's contexts, H, width]
    v: torch.Tensor,  # [sum of the group's contexts, H, v (or width)]
    out: torch.Tensor,  # [T_p, H, v]
    starts: list[int],  # prefill_cu_seqlens_q
    context_lens: list[int],
    a: int,  # the group: sequences a .. b - 1
    b: int,
    scale: float,
) -> None:
    v_dim = out.shape[-1]
    c0, s = 0, a
    while s < b:
        lo, hi, ctx = starts[s], starts[s + 1], context_lens[s]
        # a run of n sequences of ctx tokens and no cached prefix: one batched call on views
        # (their queries and their K/V lie one after another)
        n = 1
        while (
            hi - lo == ctx
            and s + n < b
            and context_lens[s + n] == ctx
            and starts[s + n + 1] - starts[s + n] == ctx
        ):
            n += 1
        if hi > lo:
            q_s = q[lo : lo + n * (hi - lo)].unflatten(0, (n, -1)).transpose(1, 2)
            k_s = k[c0 : c0 + n * ctx].unflatten(0, (n, -1)).transpose(1, 2)
            v_s = v[c0 : c0 + n * ctx].unflatten(0, (n, -1)).transpose(1, 2)
            if hi - lo == ctx:  # [n, H, ctx, width], no cached prefix
                o = F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True, scale=scale)
            else:  # one sequence whose queries are the last hi - lo of ctx positions
                # imported here: the module pulls in torch._dynamo (~0.8 s a process)
                from torch.nn.attention.bias import causal_lower_right

                mask = causal_lower_right(hi - lo, ctx)
                o = F.scaled_dot_product_attention(q_s, k_s, v_s, mask, scale=scale)
            out[lo : lo + n * (hi - lo)] = o[..., :v_dim].transpose(1, 2).flatten(0, 1)
        c0 += n * ctx
        s += n

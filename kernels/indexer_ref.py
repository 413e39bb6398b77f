"""The lightning indexer's top-k over a paged key cache (DeepSeek-V3.2 and V4's CSA): the
torch reference (the CPU path, and the oracle of kernels/triton_indexer.py).

Each query ``t`` has ``H`` indexer heads ``q[t, h]`` (``D`` values) and a float32 weight
per head; it belongs to sequence ``query_seq[t]`` and may see that sequence's keys
``0 .. num_visible[t] - 1`` (V3.2: the tokens up to its own position; V4: the closed
compressed entries). Key ``k`` of a sequence is in row ``k % B`` of block
``block_tables[s, k // B]`` of ``key_cache [N, B, row]``, at the place ``KeyFormat`` names.
The score of key k for query t, in float32:

    sum_h weights[t, h] * relu(q[t, h] . key_k) * D**-0.5

(callers fold their other scales, e.g. ``H**-0.5``, into ``weights``). The answer is the
indices of the ``topk`` highest-scoring visible keys of each query, ``[T, topk]`` int32,
in descending score order (equal scores: torch.topk's order), ``-1`` in the columns past
the number of visible keys.

Equal scores are common (a key every head scores below zero scores exactly 0), and which
of them torch.topk keeps depends on the width of the row it ranks, the masked keys past
the visible ones included. ``row_keys[t]`` is that width: transformers ranks each query
over every key its sequence has at the end of the step (``min(index_topk, keys)`` of them),
whatever part of the step holds the query, so a PCP piece, a short sequence batched with a
long one and the whole prompt alike must rank over the same ``row_keys`` (``rank_rows``).
None: one width for all, the keys the step's queries see at most.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from pdserve.kernels import fp8_ds_mla, fp8_ds_v4

# query chunk of the reference: at most this many float32 scores [chunk, H, keys] at once
_SCORE_BUDGET = 1 << 25


@dataclass(frozen=True)
class KeyFormat:
    """Where a cache row holds its indexer key and how it decodes.

    ``offset``: the key's first element (a row of the model's dtype) or first byte (``fp8``:
    a uint8 row); ``dim``: its values. An fp8 key is kernels/fp8_ds_mla.py ``quantize_keys``'s
    bytes: ``dim`` float8_e4m3fn values, then one float32 scale per 128 of them."""

    offset: int
    dim: int
    fp8: bool = False

    @staticmethod
    def v32(kv_lora_rank: int, rope_dim: int, index_dim: int, fp8: bool) -> KeyFormat:
        """DeepSeek-V3.2's row: latent, rope, then the key (fp8: the 656-byte fp8_ds_mla
        record, then the 132-byte key)."""
        if fp8:
            return KeyFormat(fp8_ds_mla.record_bytes(kv_lora_rank, rope_dim), index_dim, True)
        return KeyFormat(kv_lora_rank + rope_dim, index_dim)

    @staticmethod
    def v4_entry(head_dim: int, rope_dim: int, index_dim: int, fp8: bool) -> KeyFormat:
        """DeepSeek-V4's CSA compressed entry: the K=V entry, then the key (fp8:
        kernels/fp8_ds_v4.py ``pack_entries``: the K=V record, then the key's fp8 form)."""
        if fp8:
            return KeyFormat(fp8_ds_v4.kv_bytes(head_dim, rope_dim), index_dim, True)
        return KeyFormat(head_dim, index_dim)

    @property
    def width(self) -> int:
        """Elements (fp8: bytes) of the row from ``offset`` the key takes."""
        return fp8_ds_mla.key_bytes(self.dim) if self.fp8 else self.dim

    def check(self, key_cache: torch.Tensor) -> None:
        if key_cache.dim() != 3:
            raise ValueError(f"key_cache must be [N, B, row], got {tuple(key_cache.shape)}")
        if self.fp8 != (key_cache.dtype == torch.uint8):
            raise ValueError(f"{self} does not read a {key_cache.dtype} cache")
        if self.offset + self.width > key_cache.shape[-1]:
            raise ValueError(f"{self} overruns a {key_cache.shape[-1]}-wide row")

    def decode(self, rows: torch.Tensor) -> torch.Tensor:  # [..., row] -> [..., dim] float32
        part = rows[..., self.offset : self.offset + self.width]
        if self.fp8:
            return fp8_ds_mla.dequantize_keys(part, self.dim, torch.float32)
        return part.float()


def check_args(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    key_format: KeyFormat,
    block_tables: torch.Tensor,
    query_seq: torch.Tensor,
    num_visible: torch.Tensor,
    topk: int,
) -> None:
    key_format.check(key_cache)
    num_tokens, _, dim = q.shape
    if dim != key_format.dim:
        raise ValueError(f"queries of {dim} values, keys of {key_format.dim}")
    if weights.shape != q.shape[:2]:
        raise ValueError(f"weights {tuple(weights.shape)} for queries {tuple(q.shape)}")
    if query_seq.shape != (num_tokens,) or num_visible.shape != (num_tokens,):
        raise ValueError("query_seq and num_visible need one value per query")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], got {block_tables.shape}")
    if topk < 1:
        raise ValueError(f"topk must be positive, got {topk}")


def gather_keys(
    key_cache: torch.Tensor,  # [N, B, row]
    key_format: KeyFormat,
    block_tables: torch.Tensor,  # [S, max_blocks]
    num_keys: int,
) -> torch.Tensor:  # [S, num_keys, D] float32: keys 0 .. num_keys - 1 of every sequence
    size = key_cache.shape[1]
    pos = torch.arange(num_keys, device=key_cache.device)
    blocks = block_tables[:, pos // size].long()  # [S, num_keys]
    return key_format.decode(key_cache[blocks, pos % size])


def indexer_topk(
    q: torch.Tensor,  # [T, H, D]
    weights: torch.Tensor,  # [T, H] float32
    key_cache: torch.Tensor,  # [N, B, row]
    key_format: KeyFormat,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_seq: torch.Tensor,  # [T] int32: each query's row of block_tables
    num_visible: torch.Tensor,  # [T] int32: the keys 0 .. n - 1 it may see
    topk: int,
    row_keys: torch.Tensor | None = None,  # [T] int32: the width each query is ranked over
) -> torch.Tensor:  # [T, topk] int32, descending score, -1 past the visible keys
    check_args(q, weights, key_cache, key_format, block_tables, query_seq, num_visible, topk)
    num_tokens, num_heads, dim = q.shape
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    if num_tokens == 0:
        return out
    num_keys = int(num_visible.max())
    if num_keys <= 0:
        return out
    if row_keys is not None:  # the keys past the visible ones are ranked (at -inf) too
        num_keys = max(num_keys, int(row_keys.max()))
    keys = gather_keys(key_cache, key_format, block_tables, num_keys)  # [S, L, D]
    one_seq = keys.shape[0] == 1
    chunk = max(1, _SCORE_BUDGET // (num_heads * num_keys))
    kk = min(topk, num_keys)
    pos = torch.arange(num_keys, device=q.device)
    for lo in range(0, num_tokens, chunk):  # query chunks, bounded memory
        hi = min(num_tokens, lo + chunk)
        qc = q[lo:hi].float()
        # transformers' order: fp32 [n, H, D] x [D, L] scores, then the head-weighted sum
        # as [n, 1, H] x [n, H, L] (one sequence: the one GEMM transformers runs)
        if one_seq:
            scores = torch.matmul(qc, keys[0].t())
        else:
            scores = torch.matmul(qc, keys[query_seq[lo:hi].long()].transpose(1, 2))
        scores = scores * dim**-0.5
        index = torch.matmul(weights[lo:hi, None, :].float(), F.relu(scores))[:, 0]  # [n, L]
        visible = pos[None, :] < num_visible[lo:hi, None]
        index = index.masked_fill(~visible, float("-inf"))
        if row_keys is None:
            top = index.topk(kk, dim=-1)
            ids = top.indices.to(torch.int32).masked_fill(top.values == float("-inf"), -1)
            out[lo:hi, :kk] = ids
        else:
            out[lo:hi] = rank_rows(index, row_keys[lo:hi], topk)
    return out


def rank_rows(
    index: torch.Tensor,  # [n, L] float32: scores, -inf past each row's visible keys
    row_keys: torch.Tensor,  # [n]: the width each row is ranked over (<= L)
    topk: int,
) -> torch.Tensor:  # [n, topk] int32: as transformers' topk(min(topk, width)) of each row
    """Each row's ``min(topk, width)`` best of its first ``row_keys`` columns, one
    torch.topk per distinct width (a host read: the widths of the step's sequences), so
    equal scores resolve as they do over that width alone (see the module's docstring)."""
    out = torch.full((index.shape[0], topk), -1, dtype=torch.int32, device=index.device)
    widths = row_keys.long().clamp(max=index.shape[1])
    for width in widths.unique().tolist():
        kk = min(topk, width)
        if kk <= 0:
            continue
        rows = (widths == width).nonzero().squeeze(1)
        top = index[rows, :width].topk(kk, dim=-1)
        ids = top.indices.to(torch.int32).masked_fill(top.values == float("-inf"), -1)
        out[rows, :kk] = ids
    return out

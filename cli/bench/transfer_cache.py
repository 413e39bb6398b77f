"""The cache a ``pdserve bench transfer`` row moves (cli/bench/transfer_peers.py runs the two
processes): the model shapes and their layouts, a pattern of (block id, position) written
through the logical view and checked after a pull, and the raw NIXL agent of the
one-descriptor ceiling.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pdserve.common.engine.kv_layout import KVLayout

# Llama-3.2-1B and Llama-3.1-8B: KV heads, head_dim and layers are what set the bytes.
# dsv3: DeepSeek-V3's MLA latent cache, one row of 512 + 64 per token on each of 61 layers.
SHAPES: dict[str, dict[str, int]] = {
    "1b": {"num_layers": 16, "num_kv_heads": 8, "head_dim": 64},
    "8b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    "dsv3": {"num_layers": 61, "num_kv_heads": 1, "head_dim": 576, "num_kv_parts": 1},
}
BLOCK_SIZE = 64
DTYPE = "bfloat16"
ENGINE_ID, EPOCH = "bench-prefill", 1
COMPAT = {"model": "bench-transfer", "kv_cache_dtype": DTYPE}
PATTERN_MOD = 251  # pattern values stay integers < 256: exact in bfloat16


def make_layout(shape: str, num_blocks: int, order: str = "head", dtype: str = DTYPE) -> KVLayout:
    from pdserve.common.engine.kv_layout import KVLayout
    from pdserve.common.engine.latent_format import FP8_DTYPE, LatentFormat

    dims = dict(SHAPES[shape])
    if dims.get("num_kv_parts") == 1 and dtype == FP8_DTYPE:  # MLA fp8: fp8_ds_mla records
        fmt = LatentFormat(kv_lora_rank=512, rope_dim=64, dtype=DTYPE, kind="fp8_ds_mla")
        dims["head_dim"], dtype = fmt.elements, fmt.storage_dtype  # 656 uint8
    return KVLayout(num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=dtype, order=order, **dims)


def compat_of(dtype: str) -> dict[str, str]:
    return {**COMPAT, "kv_cache_dtype": dtype}


def num_blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def cache_blocks(shape: str, max_tokens: int) -> int:
    """Blocks of each side's cache: twice the largest pull (fragmented remote ids span
    twice the blocks; the consumer's second half is the local copy's destination), made
    distinct from every other dimension so that the block axis can be found in the shape."""
    num, others = 2 * num_blocks_for(max_tokens), set(make_layout(shape, 1).shape)
    while num in others:
        num += 1
    return num


def block_dim(layout: KVLayout) -> int:
    dims = [i for i, d in enumerate(layout.shape) if d == layout.num_blocks]
    assert len(dims) == 1, (layout.shape, layout.num_blocks)
    return dims[0]


def fragmented_ids(num_blocks: int, run_blocks: int) -> list[int]:
    """Remote ids in runs of ``run_blocks`` separated by gaps as long: 1 = every other block."""
    return [(i // run_blocks) * 2 * run_blocks + i % run_blocks for i in range(num_blocks)]


# -- the cache's content: a pattern of (block id, position in the block) ------------------


def fill(cache: torch.Tensor, layout: KVLayout) -> None:
    """Every block b holds (flat index within the block + 37 b) mod 251."""
    import torch

    blocks = cache.movedim(block_dim(layout), 0)  # [num_blocks, ...rest], maybe strided
    base = torch.arange(blocks[0].numel(), device=cache.device, dtype=torch.float32) % PATTERN_MOD
    for b in range(layout.num_blocks):
        values = (base + 37 * b) % PATTERN_MOD
        blocks[b].copy_(values.view(blocks[b].shape))


def check(
    cache: torch.Tensor, layout: KVLayout, local_ids: list[int], remote_ids: list[int]
) -> None:
    """Samples of every pulled block equal the producer's pattern for its remote id."""
    import torch

    blocks = cache.movedim(block_dim(layout), 0)
    numel = blocks[0].numel()
    gen = torch.Generator().manual_seed(0)
    flat = torch.cat(
        [torch.tensor([0, 1, numel // 2, numel - 1]), torch.randint(numel, (28,), generator=gen)]
    )
    index = torch.unravel_index(flat, tuple(blocks.shape[1:]))
    index = tuple(i.to(cache.device) for i in index)
    for lo, r in zip(local_ids, remote_ids, strict=True):
        got = blocks[lo][index].float().cpu()
        want = (((flat % PATTERN_MOD) + 37 * r) % PATTERN_MOD).float()
        want = want.to(cache.dtype).float()  # as stored: fp8 rounds the pattern (17 -> 16)
        if not torch.equal(got, want):
            raise AssertionError(
                f"pulled block {r} -> {lo} holds wrong bytes: {got[:6]} vs {want[:6]}"
            )


# -- raw NIXL: the single-descriptor ceiling ----------------------------------------------


class RawAgent:
    """A plain NIXL agent (UCX, no progress thread, like ours) over the same cache memory."""

    def __init__(self, name: str, cache: torch.Tensor, num_threads: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        config = nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], num_threads=num_threads
        )
        self.agent: Any = nixl_agent(name, config)
        flat = storage_bytes(cache)
        self.reg = self.agent.register_memory(flat)
        self.mem_type = "DRAM" if cache.device.type == "cpu" else "VRAM"
        self.device_id = 0 if cache.device.type == "cpu" else cache.get_device()
        self.base = flat.data_ptr()

    def dlist(self, agent: str, base: int, num_bytes: int) -> Any:
        import numpy as np

        rows = np.array([[base, num_bytes, self.device_id]], dtype=np.uint64)
        return self.agent.prep_xfer_dlist(agent, rows, self.mem_type)

    def read(self, remote: str, remote_base: int, num_bytes: int) -> tuple[Any, Any]:
        """Prepared lists of one descriptor each: [remote_base, +num_bytes) into the start
        of our cache, read the way KVConsumer reads (make_prepped_xfer per READ)."""
        return self.dlist("NIXL_INIT_AGENT", self.base, num_bytes), self.dlist(
            remote, remote_base, num_bytes
        )

    def run(self, lists: tuple[Any, Any]) -> float:
        import numpy as np

        index = np.zeros(1, dtype=np.int32)
        start = time.perf_counter()
        xfer = self.agent.make_prepped_xfer("READ", lists[0], index, lists[1], index)
        state = self.agent.transfer(xfer)
        while state == "PROC":
            state = self.agent.check_xfer_state(xfer)
        seconds = time.perf_counter() - start
        xfer.release()
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ failed: state {state}")
        return seconds

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)


def sync_device(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def new_cache(layout: KVLayout, device: str) -> torch.Tensor:
    """A zeroed cache in the memory order kv_transfer expects, as its logical view."""
    import torch

    from pdserve.common.engine import kv_cache

    torch.set_num_threads(1)  # the local copy is one memcpy stream, as CMA is one reader
    return kv_cache.new_cache(layout, device)


def storage_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The whole storage behind a (possibly permuted) cache view, as flat bytes."""
    import torch

    storage = cache.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=cache.device).set_(storage)

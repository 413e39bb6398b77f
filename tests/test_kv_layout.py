"""KVLayout's two storage orders (pure): the logical view, the units' byte offsets, and
which order a deployment picks from its TP sizes."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.engine.kv_cache import new_cache, storage_of
from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.runtime.service_config import DeploymentConfig


@pytest.mark.parametrize("order", ["head", "block"])
def test_unit_offsets_match_the_logical_view(order: str) -> None:
    layout = KVLayout(
        num_blocks=5,
        num_layers=3,
        num_kv_heads=4,
        block_size=2,
        head_dim=8,
        dtype="float32",
        order=order,
    )
    cache = new_cache(layout)
    assert tuple(cache.shape) == layout.shape
    storage = storage_of(cache, layout)
    assert storage.is_contiguous() and tuple(storage.shape) == layout.storage_shape
    cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).view(layout.shape))
    flat = storage.reshape(-1)
    unit = layout.head_block_bytes // layout.itemsize
    for head in range(layout.num_kv_heads):
        for block in range(layout.num_blocks):
            start = layout.unit_index(head, block) * unit
            # one unit: every layer's K and V of one head of one block, in that order
            assert torch.equal(flat[start : start + unit], cache[block, :, :, head].reshape(-1))
    if order == "head":
        assert layout.head_run(2, 1, 3) == (
            layout.unit_index(2, 1) * layout.head_block_bytes,
            3 * layout.head_block_bytes,
        )
    else:
        # a block's heads are adjacent: a run of blocks with every head is one range
        assert layout.unit_index(0, 3) == layout.unit_index(layout.num_kv_heads - 1, 2) + 1
        with pytest.raises(ValueError):
            layout.head_run(0, 1, 2)


def test_deployment_picks_the_order_from_tp_sizes() -> None:
    assert DeploymentConfig().engine_for("decode").kv_order == "block"
    assert DeploymentConfig(prefill_tp=2, decode_tp=2).engine_for("prefill").kv_order == "block"
    mixed = DeploymentConfig(prefill_tp=2, decode_instances=2, decode_tp=[2, 4])
    assert mixed.engine_for("prefill").kv_order == mixed.engine_for("decode").kv_order == "head"
    forced = DeploymentConfig(engine={"kv_order": "head"})
    assert forced.engine_for("decode").kv_order == "head"


def test_a_bad_order_is_refused() -> None:
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(
            b'{"num_blocks":1,"num_layers":1,"num_kv_heads":1,"block_size":1,'
            b'"head_dim":1,"dtype":"float32","order":"diagonal"}',
            type=KVLayout,
        )

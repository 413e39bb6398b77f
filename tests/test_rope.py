"""RoPE frequencies against Hugging Face's own definitions for each scaling variant."""

import pytest
import torch

from pdserve.common.model.layers.rope import inv_frequencies

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_scaled_frequencies_match_transformers(name: str) -> None:
    scaling = dict(VARIANTS[name])
    theta, head_dim, max_pos = 500000.0, 128, 131072
    cfg = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=max_pos,
        rope_parameters={"rope_theta": theta, **scaling},
    )
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    inv, scale = inv_frequencies(head_dim, theta, scaling, max_pos)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_plain_rope_has_unit_scale() -> None:
    inv, scale = inv_frequencies(64, 10000.0, None, 2048)
    assert scale == 1.0 and inv.shape == (32,)
    assert inv[0] == 1.0 and inv[-1] == pytest.approx(10000.0 ** (-62 / 64))

"""A random DSpark draft in DeepSpec's checkpoint format, for tests and benchmarks.

DeepSpec saves its ``Qwen3DSparkModel`` with ``save_pretrained``: config.json is the
target's config with the draft's fields set (``architectures: ["Qwen3DSparkModel"]``,
``num_hidden_layers`` the draft's layers, ``num_target_layers``, ``block_size``,
``mask_token_id``, ``target_layer_ids``, ``num_anchors``, ``markov_rank``,
``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``,
``tie_word_embeddings: false``, one ``full_attention`` per layer), the weights one
model.safetensors under the module's own names (no ``model.`` prefix). This writes the
same, with seeded normal weights (norms at one, biases at zero) and, as DeepSpec's training
starts, the target's embeddings and LM head copied in. ``add_random_v4_dspark`` gives a
DeepSeek-V4 checkpoint its own DSpark module, as the official V4 checkpoints carry it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pdserve.common.model.dspark import ARCHITECTURE, DSparkConfig, DSparkDraft


def save_random_dspark(
    path: Path,
    target: Path,
    *,
    num_layers: int = 1,
    block_size: int = 7,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    markov_rank: int = 0,
    markov_head_type: str = "vanilla",
    confidence_head: bool = False,
    confidence_head_with_markov: bool = True,
    std: float = 0.02,
    seed: int = 0,
    copy_target_head: bool = True,
) -> Path:
    """Write a random draft for the checkpoint at ``target`` into ``path``;
    ``target_layer_ids`` default: the first, middle and next-to-last layers (never the
    last, which DeepSpec refuses)."""
    raw = json.loads((target / "config.json").read_text())
    num_target = int(raw["num_hidden_layers"])
    ids = target_layer_ids or sorted({0, (num_target - 1) // 2, max(num_target - 2, 0)})
    raw.update(
        architectures=[ARCHITECTURE],
        num_target_layers=num_target,
        num_hidden_layers=num_layers,
        block_size=block_size,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * num_layers,
        mask_token_id=raw["vocab_size"] - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=ids,
        num_anchors=512,
        enable_confidence_head=confidence_head,
        markov_rank=markov_rank,
    )
    if confidence_head:
        raw["confidence_head_with_markov"] = confidence_head_with_markov
    if markov_rank:
        raw["markov_head_type"] = markov_head_type
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    draft = DSparkDraft(DSparkConfig.from_dir(path))
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in draft.state_dict().items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones_like(tensor)
        elif name.endswith(".bias"):
            state[name] = torch.zeros_like(tensor)
        else:
            state[name] = std * torch.randn(tensor.shape, generator=gen)
    if copy_target_head:
        from safetensors.torch import load_file

        held = {k: v for f in sorted(target.glob("*.safetensors")) for k, v in load_file(f).items()}
        embed = held["model.embed_tokens.weight"]
        state["embed_tokens.weight"] = embed.float().clone()
        state["lm_head.weight"] = held.get("lm_head.weight", embed).float().clone()
    from safetensors.torch import save_file

    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def add_random_v4_dspark(
    path: Path,
    *,
    num_stages: int = 3,
    block_size: int = 5,
    target_layer_ids: list[int] | None = None,
    noise_token_id: int | None = None,
    markov_rank: int = 16,
    std: float = 0.05,
    seed: int = 0,
) -> Path:
    """Give the DeepSeek-V4 checkpoint at ``path`` a seeded random DSpark module as
    V4-Flash-DSpark / -0731 carry it: the ``dspark_*`` keys in config.json and the stages'
    tensors under their names (``mtp.N.*``, common/model/dspark_v4.py) in
    ``mtp.safetensors``. ``target_layer_ids`` default: the last three layers (V4-Flash's
    [40, 41, 42] of 43). Norms at one, the hyper-connections' scales at one; routing
    biases, sinks and the hyper-connections' biases drawn like the rest (none left at the
    constant a fresh module holds, so each path matters)."""
    from safetensors.torch import save_file
    from torch import nn

    from pdserve.common.model.config import ModelConfig
    from pdserve.common.model.dspark_v4 import V4DSparkConfig, V4DSparkDraft

    raw = json.loads((path / "config.json").read_text())
    n = int(raw["num_hidden_layers"])
    raw.update(
        dspark_block_size=block_size,
        dspark_noise_token_id=raw["vocab_size"] - 1 if noise_token_id is None else noise_token_id,
        dspark_target_layer_ids=target_layer_ids or list(range(max(n - 3, 0), n)),
        dspark_markov_rank=markov_rank,
    )
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    target = ModelConfig.from_dir(path)
    assert target.v4 is not None
    cfg = V4DSparkConfig(
        block_size=block_size,
        mask_token_id=raw["dspark_noise_token_id"],
        target_layer_ids=tuple(raw["dspark_target_layer_ids"]),
        markov_rank=markov_rank,
        num_stages=num_stages,
        window=target.sliding_window or 128,
        num_experts=target.v4.num_experts,
        top_k=target.v4.top_k,
    )
    with torch.device("meta"):
        draft = V4DSparkDraft(cfg, target, nn.Embedding(1, 1), nn.Linear(1, 1))
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in draft.state_dict().items():
        if name.endswith("norm.weight") or name.endswith("_scale"):
            state[name] = torch.ones(tensor.shape)
        elif name.endswith(("_base", "attn_sink", "gate.bias")):
            state[name] = 0.5 * torch.randn(tensor.shape, generator=gen)
        else:
            state[name] = std * torch.randn(tensor.shape, generator=gen)
    save_file(state, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    return path

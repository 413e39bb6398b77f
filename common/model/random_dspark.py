"""A random DSpark draft in DeepSpec's checkpoint format, for tests and benchmarks.

DeepSpec saves its ``Qwen3DSparkModel`` with ``save_pretrained``: config.json is the
target's config with the draft's fields set (``architectures: ["Qwen3DSparkModel"]``,
``num_hidden_layers`` the draft's layers, ``num_target_layers``, ``block_size``,
``mask_token_id``, ``target_layer_ids``, ``num_anchors``, ``markov_rank``,
``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``,
``tie_word_embeddings: false``, one ``full_attention`` per layer), the weights one
model.safetensors under the module's own names (no ``model.`` prefix). This writes the
same, with seeded normal weights (norms at one, biases at zero) and, as DeepSpec's training
starts, the target's embeddings and LM head copied in.
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

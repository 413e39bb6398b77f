"""DeepSeek checkpoints with multi-token-prediction (MTP) layer weights
(``num_nextn_predict_layers`` > 0, tensors of layer index ``num_hidden_layers``): the model
loads without them (common/model/draft/mtp.py: not read, one ``mtp_layers_skipped`` note) and
generates exactly what it does on the checkpoint without them; weights of any other extra
layer are still refused. The speculative method ``mtp``, which loads them: tests/test_mtp_spec.py.

The MTP layer is written as DeepSeek-V3's checkpoints hold it: the decoder layer's own
tensors (attention, norms, MLP or routed experts) plus ``enorm``, ``hnorm``, ``eh_proj``,
``embed_tokens`` and ``shared_head``, on random checkpoints of transformers' classes
(dense, and with a MoE layer so that the expert reader skips them too).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog
import torch
from safetensors.torch import load_file, save_file

from pdserve.common.errors import ModelLoadError
from pdserve.common.model.fixtures.random import save_random_model
from tests.test_families import engine_greedy
from tests.test_mla import build_mla
from tests.test_moe_deepseek import DEEPSEEK_MODEL

pytest.importorskip("transformers")

PROMPTS = [[(i * 31 + 7) % 30000 + 100 for i in range(n)] for n in (5, 40)]


def _build(root: Path, kind: str, tokenizer_from: Path) -> Path:
    if kind == "dense":
        return build_mla(root, "v3-yarn", tokenizer_from=tokenizer_from)
    return save_random_model(
        root / "moe", "deepseek_v3", max_position_embeddings=4096, seed=1,
        tokenizer_from=tokenizer_from, **DEEPSEEK_MODEL,
    )  # fmt: skip


def add_extra_layer(model: Path, index: int) -> int:
    """Write layer ``index`` as an MTP layer into the checkpoint (a copy of the last decoder
    layer's tensors plus the MTP projections); returns how many tensors it added."""
    [path] = sorted(model.glob("*.safetensors"))
    state = load_file(path)
    cfg = json.loads((model / "config.json").read_text())
    last, hidden = f"model.layers.{cfg['num_hidden_layers'] - 1}.", cfg["hidden_size"]
    new = f"model.layers.{index}."
    extra = {new + k[len(last) :]: v.clone() for k, v in state.items() if k.startswith(last)}
    gen = torch.Generator().manual_seed(index)
    extra |= {
        new + "enorm.weight": torch.ones(hidden),
        new + "hnorm.weight": torch.ones(hidden),
        new + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen),
        new + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
        new + "shared_head.norm.weight": torch.ones(hidden),
        new + "shared_head.head.weight": state["lm_head.weight"].clone(),
    }
    save_file({**state, **extra}, path, metadata={"format": "pt"})
    return len(extra)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_mtp_layer_weights_are_skipped_with_a_note(
    tmp_path: Path, model_dir: Path, kind: str
) -> None:
    model = _build(tmp_path, kind, model_dir)
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1  # transformers' V3 default
    want = engine_greedy(model, PROMPTS)
    num_tensors = add_extra_layer(model, cfg["num_hidden_layers"])
    # another test may have configured a level filter (info dropped before any processor):
    # capture with structlog's defaults, then put the configuration back
    saved = structlog.get_config()
    structlog.reset_defaults()
    try:
        with structlog.testing.capture_logs() as logs:
            got = engine_greedy(model, PROMPTS)
    finally:
        structlog.configure(**saved)
    assert got == want
    notes = [e for e in logs if e["event"] == "mtp_layers_skipped"]
    assert len(notes) == 1, logs
    assert notes[0]["layers"] == [cfg["num_hidden_layers"]]
    assert notes[0]["num_tensors"] == num_tensors


def test_other_extra_layers_are_still_refused(tmp_path: Path, model_dir: Path) -> None:
    model = _build(tmp_path, "dense", model_dir)
    add_extra_layer(model, 3)  # 2 layers + 1 MTP layer: index 3 is nobody's
    with pytest.raises(ModelLoadError, match=r"unexpected \['model\.layers\.3\."):
        engine_greedy(model, PROMPTS)
    no_mtp = build_mla(tmp_path / "no-mtp", "v3-yarn", tokenizer_from=model_dir)
    raw = json.loads((no_mtp / "config.json").read_text())
    (no_mtp / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 0}))
    add_extra_layer(no_mtp, 2)  # the config declares no MTP layer: layer 2 is unexpected
    with pytest.raises(ModelLoadError, match=r"unexpected \['model\.layers\.2\."):
        engine_greedy(no_mtp, PROMPTS)

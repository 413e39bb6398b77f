"""MLA (DeepSeek V2/V3, dense layers) against Hugging Face transformers, token for token.

Checkpoints are built by transformers' own DeepseekV3/V2 classes (random weights, float32,
the embedded model's tokenizer, first_k_dense_replace = num_hidden_layers): q low-rank and
not, several kv_lora / rope / nope / v sizes, yarn rope with mscale != mscale_all_dim, rope
interleaved and not, attention bias. Our engine caches one latent row per token and layer,
prefills by expanding it into per-head K/V and decodes in the absorbed form
(common/model/layers/mla.py); greedy output must equal HF ``generate``'s.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.latent_format import LatentFormat, cache_head
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.kernels import mla_reference
from tests.test_families import PROMPT_LENGTHS, engine_greedy, hf_greedy

transformers = pytest.importorskip("transformers")

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}

MLA_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # q low-rank, yarn (softmax scale and cos/sin scaled), interleaved rope
    "v3-yarn": (
        "deepseek_v3",
        {
            **SMALL,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "rope_scaling": YARN,
        },
    ),
    # one q_proj, rope_interleave off, biases on q_a/kv_a/o_proj, v wider than nope
    "v3-no-q-lora": (
        "deepseek_v3",
        {
            **SMALL,
            "q_lora_rank": None,
            "kv_lora_rank": 64,
            "qk_rope_head_dim": 32,
            "qk_nope_head_dim": 24,
            "v_head_dim": 40,
            "rope_interleave": False,
            "attention_bias": True,
        },
    ),
    # DeepSeek V2: complex (interleaved) rope, 8 heads
    "v2": (
        "deepseek_v2",
        {
            **SMALL,
            "num_attention_heads": 8,
            "q_lora_rank": 48,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
        },
    ),
}


def build_mla(
    root: Path, name: str, num_layers: int = 2, tokenizer_from: Path | None = None
) -> Path:
    from pdserve.common.model.fixtures.random import save_random_model

    model_type, config = MLA_MODELS[name]
    return save_random_model(
        root / name,
        model_type,
        max_position_embeddings=4096,
        seed=2,
        tokenizer_from=tokenizer_from,
        num_hidden_layers=num_layers,
        first_k_dense_replace=num_layers,  # dense: MoE is issue #16
        **config,
    )


@pytest.fixture(scope="module")
def mla_checkpoints(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[str, Path]:
    # the test model's tokenizer (PDSERVE_TEST_MODEL on the GPU machine, else the embedded one)
    root = tmp_path_factory.mktemp("mla")
    return {name: build_mla(root, name, tokenizer_from=model_dir) for name in MLA_MODELS}


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer

    text = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 120
    ids = Tokenizer.from_dir(model_dir).encode(text)
    return [ids[:n] for n in PROMPT_LENGTHS]


def test_config_reads_mla_as_transformers_does(mla_checkpoints: dict[str, Path]) -> None:
    for name, path in mla_checkpoints.items():
        cfg = ModelConfig.from_dir(path)
        hf = transformers.AutoConfig.from_pretrained(path)
        assert cfg.is_mla and cfg.num_key_value_heads == 1, name
        assert cfg.head_dim == hf.qk_rope_head_dim == cfg.qk_rope_head_dim
        # one cache row a token: the latent and its rope part, K and V at once
        assert cache_head(cfg, "float32") == (hf.kv_lora_rank + hf.qk_rope_head_dim, 1, "float32")
        assert cfg.q_lora_rank == hf.q_lora_rank
        assert cfg.rope_interleave == (name != "v3-no-q-lora")
        attn = transformers.AutoModelForCausalLM.from_config(hf).model.layers[0].self_attn
        assert cfg.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    yarn = ModelConfig.from_dir(mla_checkpoints["v3-yarn"])
    m = 0.1 * math.log(4.0) + 1.0  # mscale(factor, mscale_all_dim = 1) squared
    assert yarn.softmax_scale == pytest.approx(32**-0.5 * m * m)


def test_moe_layers_of_v3_are_read_and_v2_routing_is_refused() -> None:
    raw = {
        "model_type": "deepseek_v3",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "first_k_dense_replace": 1,
    }
    moe = ModelConfig.from_dict(raw).moe  # transformers' defaults: 256 experts, 8 a token
    assert moe is not None and moe.sparse_layers == (1, 2, 3) and moe.num_experts == 256
    default = ModelConfig.from_dict({k: v for k, v in raw.items() if k != "first_k_dense_replace"})
    assert default.moe is not None and default.moe.sparse_layers == (3,)  # V3's default is 3
    with pytest.raises(ModelLoadError, match=r"layers 1\.\.3 are mixture-of-experts.*not V2's"):
        ModelConfig.from_dict({**raw, "model_type": "deepseek_v2"})
    assert ModelConfig.from_dict({**raw, "first_k_dense_replace": 4}).is_mla


def test_latent_layout_bytes() -> None:
    """One row per token and layer, no heads, no K/V pair: (512 + 64) x 2 bytes in bf16."""
    fmt = LatentFormat(kv_lora_rank=512, rope_dim=64, dtype="bfloat16")
    assert fmt.token_bytes == 1152 and fmt.elements == 576
    assert [s.name for s in fmt.sections] == ["latent", "rope"]
    cfg = ModelConfig.from_dict(
        {
            "model_type": "deepseek_v3",
            "vocab_size": 100,
            "hidden_size": 7168,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 128,
        }
    )
    head_dim, parts, dtype = cache_head(cfg, "bfloat16")
    layout = KVLayout(
        num_blocks=10, num_layers=3, num_kv_heads=1, block_size=64, head_dim=head_dim,
        dtype=dtype, num_kv_parts=parts, order="block",
    )  # fmt: skip
    assert layout.bytes_per_token == 3 * 1152
    assert layout.shape == (10, 3, 1, 1, 64, 576)
    with pytest.raises(ValueError, match="not supported"):
        LatentFormat(kv_lora_rank=512, rope_dim=64, dtype="bfloat16", kind="fp9")


def test_absorbed_decode_reference_equals_expanded_attention() -> None:
    """The absorbed decode (q through W_UK, latent rows as K and V, out through W_UV) is
    the attention of per-head K/V expanded by kv_b_proj, on a paged cache."""
    gen = torch.Generator().manual_seed(0)
    heads, latent, rope, nope, v_dim, block = 4, 32, 16, 8, 12, 16
    w = torch.randn(heads, nope + v_dim, latent, generator=gen, dtype=torch.float64)
    lens = [5, 40, 16]
    cache = torch.full((12, 1, 1, block, latent + rope), float("nan"), dtype=torch.float64)
    tables = torch.tensor([[3, 0, 0], [7, 1, 9], [2, 0, 0]], dtype=torch.int32)
    rows = [torch.randn(n, latent + rope, generator=gen, dtype=torch.float64) for n in lens]
    for s, r in enumerate(rows):
        slots = torch.tensor(
            [int(tables[s, p // block]) * block + p % block for p in range(len(r))]
        )
        mla_reference.write_latent(cache, r, slots)
    q_nope = torch.randn(3, heads, nope, generator=gen, dtype=torch.float64)
    q_rope = torch.randn(3, heads, rope, generator=gen, dtype=torch.float64)
    q = torch.cat((torch.einsum("shn,hnl->shl", q_nope, w[:, :nope]), q_rope), dim=-1)
    out = mla_reference.mla_decode_attention(q, cache, torch.tensor(lens), tables, 0.3, latent)
    got = torch.einsum("shl,hvl->shv", out, w[:, nope:])
    for s, r in enumerate(rows):
        k = torch.cat((torch.einsum("tl,hnl->htn", r[:, :latent], w[:, :nope]),
                       r[None, :, latent:].expand(heads, -1, -1)), dim=-1)  # fmt: skip
        v = torch.einsum("tl,hvl->htv", r[:, :latent], w[:, nope:])
        qs = torch.cat((q_nope[s], q_rope[s]), dim=-1)[:, None]  # [H, 1, nope + rope]
        want = torch.softmax((qs @ k.transpose(1, 2)) * 0.3, dim=-1) @ v
        torch.testing.assert_close(got[s], want[:, 0])


@pytest.mark.parametrize("v_dim", [12, 40], ids=["v-narrower", "v-wider"])
@pytest.mark.parametrize(
    ("expand_tokens", "pad"), [(8192, True), (10, True), (8192, False)],
    ids=["one-group", "groups", "unpadded"],
)  # fmt: skip
def test_prefill_equals_attention_of_each_sequence(
    monkeypatch: pytest.MonkeyPatch, v_dim: int, expand_tokens: int, pad: bool
) -> None:
    """common/model/layers/mla_prefill.py: sequences without a cached prefix (two of one length,
    attended in one batched call), one whose queries follow a cached prefix, one alone, with
    v padded to the q/k width, q/k to v's or neither, in one or several expansion groups,
    against causal attention over per-head K/V expanded by kv_b_proj, sequence by sequence."""
    from pdserve.common.model.layers import mla_prefill
    from pdserve.common.model.layers.attention import AttentionMetadata

    monkeypatch.setattr(mla_prefill, "EXPAND_TOKENS", expand_tokens)
    monkeypatch.setattr(mla_prefill, "pads_value", lambda q: pad)  # unpadded: CUDA fp32's
    gen = torch.Generator().manual_seed(1)
    heads, latent, rope, nope, block = 4, 32, 16, 8, 16
    q_lens, ctxs = [5, 5, 3, 7], [5, 5, 21, 7]
    kv_b = torch.nn.Linear(latent, heads * (nope + v_dim), bias=False).double()
    tables = torch.tensor([[3, 0], [7, 0], [2, 9], [5, 0]], dtype=torch.int32)
    cache = torch.full((12, 1, 1, block, latent + rope), float("nan"), dtype=torch.float64)
    rows = [torch.randn(n, latent + rope, generator=gen, dtype=torch.float64) for n in ctxs]
    for s, r in enumerate(rows):
        pos = torch.arange(len(r))
        mla_reference.write_latent(cache, r, tables[s, pos // block].long() * block + pos % block)
    q = torch.randn(sum(q_lens), heads, nope + rope, generator=gen, dtype=torch.float64)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        num_decode_tokens=0,
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        decode_block_tables=torch.zeros((0, 2), dtype=torch.int32),
        prefill_cu_seqlens_q=torch.tensor([0, 5, 10, 13, 20], dtype=torch.int32),
        prefill_context_lens=torch.tensor(ctxs, dtype=torch.int32),
        prefill_block_tables=tables,
    )
    got = mla_prefill.mla_prefill(q[..., :nope], q[..., nope:], cache, meta, kv_b, latent,
                                  v_dim, 0.3)  # fmt: skip
    start = 0
    for r, n in zip(rows, q_lens, strict=True):
        kv = kv_b(r[:, :latent]).view(-1, heads, nope + v_dim).transpose(0, 1)
        k = torch.cat((kv[..., :nope], r[None, :, latent:].expand(heads, -1, -1)), dim=-1)
        scores = (q[start : start + n].transpose(0, 1) @ k.transpose(1, 2)) * 0.3
        visible = torch.arange(len(r))[None, :] <= torch.arange(len(r) - n, len(r))[:, None]
        want = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ kv[..., nope:]
        torch.testing.assert_close(got[start : start + n], want.transpose(0, 1))
        start += n


@pytest.mark.parametrize(
    "name", ["v3-yarn", "v3-no-q-lora", pytest.param("v2", marks=pytest.mark.slow)]
)
def test_greedy_tokens_identical_to_transformers(
    mla_checkpoints: dict[str, Path], prompts: list[list[int]], name: str
) -> None:
    want = hf_greedy(mla_checkpoints[name], prompts)
    assert engine_greedy(mla_checkpoints[name], prompts) == want


def test_small_blocks_and_chunked_prefill(
    mla_checkpoints: dict[str, Path], prompts: list[list[int]]
) -> None:
    """Blocks of 16 and 100-token chunks: prefill chunks attend latents cached by earlier
    chunks, decodes and prefills share steps (six sequences at once)."""
    want = hf_greedy(mla_checkpoints["v3-yarn"], prompts)
    got = engine_greedy(
        mla_checkpoints["v3-yarn"], prompts + prompts, block_size=16, max_num_batched_tokens=100
    )
    assert got == want + want


@pytest.mark.slow
def test_pdserve_generate_raw_on_deepseek_v3(
    mla_checkpoints: dict[str, Path], model_dir: Path
) -> None:
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer

    text = "The quick brown fox jumps over the lazy dog."
    tok = Tokenizer.from_dir(model_dir)
    [want] = hf_greedy(mla_checkpoints["v3-yarn"], [tok.encode(text)])
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "generate", "--raw", "--prompt", text]
        + ["--max-tokens", "16", "--model", str(mla_checkpoints["v3-yarn"])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == tok.decode(want) + "\n"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["v3-yarn", "v3-no-q-lora"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_cuda_fp32_greedy_identical_to_transformers(
    mla_checkpoints: dict[str, Path], prompts: list[list[int]], name: str, graphs: bool
) -> None:
    """On CUDA (fp32): the Triton latent write and absorbed decode, in CUDA graphs or not."""
    want = hf_greedy(mla_checkpoints[name], prompts)
    got = engine_greedy(
        mla_checkpoints[name],
        prompts,
        device="cuda",
        dtype="float32",
        cuda_graphs=graphs,
        num_kv_blocks=256,
    )
    assert got == want


def test_bench_shape_writer_gives_a_checkpoint_transformers_reads(
    tmp_path: Path, model_dir: Path
) -> None:
    """``write_random_deepseek`` (bench engine --shape dsv3) at a tiny size: transformers
    loads its config.json and weights, and our engine gives HF's tokens on it (yarn rope,
    interleaved, q low-rank: DeepSeek-V3's switches)."""
    from pdserve.common.model.fixtures.random_shapes import SHAPES, write_random_deepseek

    assert SHAPES["dsv3"]["kv_lora_rank"] == 512 and SHAPES["dsv3"]["num_heads"] == 128
    path = write_random_deepseek(
        tmp_path / "dsv3-tiny", num_layers=2, hidden_size=64, num_heads=4, intermediate_size=96,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        dtype="float32", tokenizer_from=model_dir,
    )  # fmt: skip
    prompts = [[(i * 7 + 3) % 40000 + 100 for i in range(n)] for n in (5, 150)]
    assert engine_greedy(path, prompts) == hf_greedy(path, prompts)


@pytest.mark.parametrize("q_lora", [16, None], ids=["q-lora", "q-proj"])
def test_tp_shards_split_heads_and_replicate_the_latent(q_lora: int | None) -> None:
    """TP 2: q (q_proj or q_b_proj) and kv_b_proj by rows of whole heads, o_proj by columns,
    everything that makes the latent (q_a/kv_a and the norms) whole on both ranks."""
    from pdserve.common.model.decoder import shard_state_dict

    raw = {
        "model_type": "deepseek_v3", "vocab_size": 50, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "first_k_dense_replace": 1,
        "num_attention_heads": 4, "q_lora_rank": q_lora, "kv_lora_rank": 8,
        "qk_rope_head_dim": 4, "qk_nope_head_dim": 6, "v_head_dim": 5,
    }  # fmt: skip
    cfg = ModelConfig.from_dict(raw)
    a = "model.layers.0.self_attn."
    shapes = {
        a + "kv_a_proj_with_mqa.weight": (12, 32),
        a + "kv_a_layernorm.weight": (8,),
        a + "kv_b_proj.weight": (4 * 11, 8),
        a + "o_proj.weight": (32, 4 * 5),
    }
    if q_lora is None:
        shapes[a + "q_proj.weight"] = (4 * 10, 32)
    else:
        shapes |= {a + "q_a_proj.weight": (16, 32), a + "q_a_layernorm.weight": (16,)}
        shapes[a + "q_b_proj.weight"] = (4 * 10, 16)
    full = {k: torch.randn(s) for k, s in shapes.items()}
    parts = [shard_state_dict(full, cfg, 2, r) for r in range(2)]
    q = a + ("q_proj.weight" if q_lora is None else "q_b_proj.weight")
    for name, tensor in full.items():
        if name in (q, a + "kv_b_proj.weight"):
            rows = tensor.shape[0] // 2  # heads 0-1 on rank 0, 2-3 on rank 1
            assert [p[name].shape[0] for p in parts] == [rows, rows]
            assert torch.equal(torch.cat([p[name] for p in parts]), tensor)
        elif name == a + "o_proj.weight":
            assert torch.equal(torch.cat([p[name] for p in parts], dim=1), tensor)
        else:
            assert all(torch.equal(p[name], tensor) for p in parts), name


def test_cuda_refuses_mla_sizes_its_kernel_cannot_tile() -> None:
    """A DeepSeek model whose latent or rope part the Triton MLA decode cannot tile (powers
    of two >= 16) is refused on CUDA before any weight is read, naming the sizes; CPU runs it."""
    from pdserve.common.engine.model_loader import check_device_supports

    def cfg(latent: int, rope: int) -> ModelConfig:
        _, kw = MLA_MODELS["v3-yarn"]
        hf = transformers.DeepseekV3Config(
            **{**kw, "kv_lora_rank": latent, "qk_rope_head_dim": rope}
        )
        return ModelConfig.from_dict(hf.to_dict())

    with pytest.raises(ModelLoadError, match="qk_rope_head_dim 8") as err:
        check_device_supports(cfg(16, 8), torch.device("cuda"))
    assert "kv_lora_rank" not in str(err.value).split("this model has")[1]
    with pytest.raises(ModelLoadError, match="kv_lora_rank 24"):
        check_device_supports(cfg(24, 16), torch.device("cuda"))
    check_device_supports(cfg(16, 8), torch.device("cpu"))
    check_device_supports(cfg(32, 16), torch.device("cuda"))

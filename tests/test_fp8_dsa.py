"""fp8 KV on DeepSeek-V3.2 (``--kv-cache-dtype fp8``): each token's row is vLLM's 656-byte
fp8_ds_mla record followed by the lightning indexer's key in vLLM's fp8 form (fp8 values, a
float32 power-of-two scale per 128): the bytes, the logits of every decode step against the
auto cache, and (slow) a disaggregated fp8 pull against the monolithic fp8 engine.

The model: a random DeepseekV32ForCausalLM of transformers' own classes (2 dense layers,
hidden 64, 4 heads, kv_lora_rank 128 and index_head_dim 128: one tile each), 4 prompts of
40-90 tokens, prefill + 32 teacher-forced decode steps each: 132 positions, CPU.

Tolerance, measured on CPU (logits of the fp8 cache against the auto cache of the same model
dtype), in two settings:

* index_topk 4096, above every context: the indexer scores fp8 keys but keeps them all, so
  this measures the record (fp8 latent, bf16 rope): float32 cosine min 0.99986, mean
  0.99992, top-1 95.5%; bfloat16 min 0.99981, top-1 98.5%; largest reference margin at a
  disagreement 0.0042. Thresholds as tests/test_fp8_mla.py's: cosine >= 0.999 at every
  position, top-1 >= 90%, and 100% where the reference's best two logits differ by > 0.05.
* index_topk 24, below every context: the top-24 over fp8 keys is not always the top-24
  over exact ones (near-equal scores swap at the cut), and a swapped key changes the
  attention: float32 cosine min 0.978, mean 0.995, top-1 84.1% overall and 97.2% where the
  margin is > 0.05 (one position of 36); bfloat16 min 0.969, top-1 81.8% and 100%. Any
  precision change does this: the bfloat16 auto cache against the float32 one (no fp8)
  gives cosine min 0.981, top-1 83.3% overall and 100% where the margin is > 0.05 on the
  same model. Thresholds: cosine mean >= 0.99, top-1 >= 75% overall and >= 90% where the
  margin is > 0.05.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.latent_format import LatentFormat, cache_head
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.kernels import fp8_ds_mla
from tests.test_dsa import build_v32
from tests.test_fp8_kv import COSINE_MIN, TOP1_MIN, _runner, _step_logits, agreement

pytest.importorskip("transformers")

FP8_V32: dict[str, Any] = {"kv_lora_rank": 128, "index_head_dim": 128, "first_k_dense_replace": 2}
ROW = 128 + 4 + 2 * 16 + 128 + 4  # fp8 latent, 1 scale, bf16 rope, fp8 key, 1 key scale


@pytest.fixture(scope="module")
def v32_fp8_model(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """index_topk 24: the selection over fp8 keys decides."""
    return build_v32(tmp_path_factory.mktemp("fp8dsa") / "v32", tokenizer_from=model_dir, **FP8_V32)


@pytest.fixture(scope="module")
def v32_fp8_dense(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """index_topk 4096: every key selected, the record alone differs."""
    root = tmp_path_factory.mktemp("fp8dsa-dense") / "v32"
    return build_v32(root, tokenizer_from=model_dir, **FP8_V32, index_topk=4096)


def test_v32_row_is_the_656_byte_record_then_the_132_byte_key() -> None:
    fmt = LatentFormat(
        kv_lora_rank=512, rope_dim=64, dtype="bfloat16", kind="fp8_ds_mla", index_dim=128
    )
    assert [(s.name, s.offset, s.num_values, s.dtype) for s in fmt.sections] == [
        ("latent", 0, 512, "float8_e4m3fn"),
        ("scales", 512, 4, "float32"),
        ("rope", 528, 64, "bfloat16"),
        ("index", 656, 128, "float8_e4m3fn"),
        ("index_scales", 784, 1, "float32"),
    ]
    assert fmt.token_bytes == fmt.elements == 788 and fmt.storage_dtype == "uint8"
    raw = {
        "model_type": "deepseek_v32", "vocab_size": 100, "hidden_size": 7168,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 128,
        "q_lora_rank": 1536,
    }  # fmt: skip
    cfg = ModelConfig.from_dict(raw)  # V3.2's defaults: 512 + 64, key 128
    assert cache_head(cfg, "bfloat16", "float8_e4m3fn") == (788, 1, "uint8")
    assert cache_head(cfg, "bfloat16") == (704, 1, "bfloat16")  # auto: 1,408 bytes
    untiled = ModelConfig.from_dict({**raw, "index_head_dim": 96})
    with pytest.raises(ValueError, match="index_head_dim to be a multiple of 128.* is 96"):
        cache_head(untiled, "bfloat16", "float8_e4m3fn")
    assert cache_head(untiled, "bfloat16") == (672, 1, "bfloat16")  # auto takes any width


def test_v32_record_bytes_round_trip() -> None:
    """Each section's bytes where the layout says, and back within fp8's rounding."""
    gen = torch.Generator().manual_seed(2)
    latent = torch.randn(3, 512, generator=gen)
    rope = torch.randn(3, 64, generator=gen)
    keys = torch.randn(3, 128, generator=gen) * torch.tensor([[0.01], [1.0], [300.0]])
    keys[0, 5] = 0.0
    row = fp8_ds_mla.quantize_indexed(latent, rope, keys)
    assert row.dtype == torch.uint8 and row.shape == (3, 788)
    scales = row[:, 512:528].contiguous().view(torch.float32)  # [3, 4]
    want = latent.view(3, 4, 128).abs().amax(-1) / 448
    torch.testing.assert_close(scales, want)
    fp8 = row[:, :512].contiguous().view(torch.float8_e4m3fn).float().view(3, 4, 128)
    torch.testing.assert_close(fp8 * scales[..., None], latent.view(3, 4, 128), rtol=0.07, atol=0)
    assert torch.equal(row[:, 528:656].contiguous().view(torch.bfloat16), rope.bfloat16())
    key_scale = row[:, 784:788].contiguous().view(torch.float32)[:, 0]  # [3]
    assert torch.equal(key_scale, torch.exp2(torch.log2(key_scale).round()))  # ue8m0
    amax = keys.abs().amax(-1)
    assert (key_scale >= amax / 448).all() and (key_scale < 2 * amax / 448).all()
    key_fp8 = row[:, 656:784].contiguous().view(torch.float8_e4m3fn).float()
    assert key_fp8[0, 5] == 0
    torch.testing.assert_close(key_fp8 * key_scale[:, None], keys, rtol=0.07, atol=1e-12)
    back = fp8_ds_mla.dequantize_indexed(row, 512, 128)  # [3, 512 + 64 + 128]
    assert torch.equal(back[:, :512], (fp8 * scales[..., None]).view(3, 512))
    assert torch.equal(back[:, 512:576], rope.bfloat16().float())
    assert torch.equal(back[:, 576:], key_fp8 * key_scale[:, None])


def test_fp8_v32_cache_holds_rows_of_records_and_keys(v32_fp8_model: Path) -> None:
    runner = _runner(v32_fp8_model, "float32", "float8_e4m3fn")
    assert runner.kv_cache.dtype == torch.uint8
    assert runner.layout.head_dim == ROW and runner.layout.bytes_per_token == 2 * ROW


def _logits_against_auto(model: Path, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(cosine [P], [agreement, clear margin] [2, P] bool) of the fp8 cache's
    logits against the auto cache's, prefill + 32 teacher-forced decode steps of 4 prompts."""
    gen = torch.Generator().manual_seed(15)
    vocab = ModelConfig.from_dir(model).vocab_size
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (40, 55, 70, 90)]
    ref, tokens = _step_logits(_runner(model, dtype, None), prompts, None, 32)
    got, _ = _step_logits(_runner(model, dtype, "float8_e4m3fn"), prompts, tokens, 32)
    ref, got = ref.flatten(0, 1), got.flatten(0, 1)  # [positions, vocab]
    cosine, agree, clear = agreement(ref, got, f"{model.parent.name} {dtype}")
    return cosine, torch.stack((agree, clear))


BF16_SLOW = pytest.param("bfloat16", marks=pytest.mark.slow)  # ~1 min each on a shared VM


@pytest.mark.parametrize("dtype", ["float32", BF16_SLOW])
def test_fp8_v32_record_tracks_the_auto_cache_every_decode_step(
    v32_fp8_dense: Path, dtype: str
) -> None:
    cosine, (agree, clear) = _logits_against_auto(v32_fp8_dense, dtype)
    assert cosine.min().item() >= COSINE_MIN
    assert agree.float().mean().item() >= TOP1_MIN
    assert agree[clear].all()


@pytest.mark.parametrize("dtype", ["float32", BF16_SLOW])
def test_fp8_v32_selection_over_fp8_keys_tracks_the_auto_cache(
    v32_fp8_model: Path, dtype: str
) -> None:
    cosine, (agree, clear) = _logits_against_auto(v32_fp8_model, dtype)
    assert cosine.mean().item() >= 0.99
    assert agree.float().mean().item() >= 0.75
    assert agree[clear].float().mean().item() >= 0.90


def test_fp8_v32_engine_generates_through_prefix_hits_and_chunks(v32_fp8_model: Path) -> None:
    """The engine on the fp8 cache: chunked prefill across blocks, then the same prompt from
    its cached fp8 rows (a prefix hit) gives the same tokens."""
    gen = torch.Generator().manual_seed(4)
    vocab = ModelConfig.from_dir(v32_fp8_model).vocab_size
    prompt = torch.randint(vocab, (150,), generator=gen).tolist()
    engine = LLMEngine(
        EngineConfig(
            model=str(v32_fp8_model), block_size=16, num_kv_blocks=64, kv_cache_dtype="fp8",
            max_num_batched_tokens=50,
        )
    )  # fmt: skip
    assert engine.runner.layout.dtype == "uint8"
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    first = engine.generate([prompt], sampling)[0].token_ids
    before = engine.scheduler.num_computed_tokens
    assert engine.generate([prompt], sampling)[0].token_ids == first
    assert engine.scheduler.num_computed_tokens - before < len(prompt) // 2


TEXTS = [
    "Monday, Tuesday,",
    "The quick brown fox jumps over the lazy dog. " * 12,  # ~120 tokens: several blocks
]
ENGINE = {"block_size": 16, "kv_cache_dtype": "fp8", "kv_cache_memory_gb": 0.05}


@pytest.mark.slow
@pytest.mark.parametrize("flags", [{}, {"pcp": 2}], ids=["tp1", "pcp2"])
def test_fp8_v32_disaggregated_pull_gives_the_monolithic_fp8_tokens(
    tmp_path: Path, v32_fp8_model: Path, flags: dict[str, int]
) -> None:
    """Prefill (TP 1, or PCP 2: each rank quantizes the same gathered rows) -> NIXL -> decode
    TP 1, both on the fp8 cache: the monolithic fp8 engine's tokens, every pool full after,
    and the decode pulled the fp8 rows of every block (ROW bytes a token and layer)."""
    from tests.e2e import deployment
    from tests.test_fp8_mla_serving import _serve
    from tests.test_serving import assert_pools_full, metrics, total

    mono = LLMEngine(EngineConfig(model=str(v32_fp8_model), **ENGINE))
    prompts = [mono.tokenizer.encode(t) for t in TEXTS]
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in mono.generate(prompts, sampling)]
    with deployment(tmp_path, v32_fp8_model, engine=ENGINE, **flags) as dep:
        got = _serve(dep.cfg.front_address, prompts)
        snap = metrics(dep.url)
        assert_pools_full(dep.url)
    assert got == want
    blocks = sum(-(-len(p) // 16) for p in prompts)
    pulled = total(snap, "pdserve:kv_transfer_bytes_total", "decode")
    assert pulled == blocks * 16 * 2 * ROW

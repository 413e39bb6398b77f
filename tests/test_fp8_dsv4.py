"""fp8 KV on DeepSeek-V4 (``--kv-cache-dtype fp8``): the K=V rows and compressed entries in
vLLM's fp8 form of them (kernels/fp8_ds_v4.py: fp8 nope values with a ue8m0 exponent byte
per 64, bf16 rope; 584 bytes in V4-Flash), CSA's indexer keys in fp8 with a float32 scale,
the compressors' projections unquantized: the bytes, the logits of every decode step against
the auto cache, and (slow) a disaggregated fp8 pull against the monolithic fp8 engine.

The model: tests/test_dsv4.py's random DeepseekV4ForCausalLM (sliding, CSA, HCA and CSA
layers, hash_moe and moe, hc_mult 4, window 16) with head_dim 128 (rope 64: one 64-value
tile of nope) and index_head_dim 128, so the fp8 forms apply; 4 prompts of 40-90 tokens,
prefill + 32 teacher-forced decode steps each: 132 positions, CPU.

Tolerance, measured on CPU against the auto cache of the same model dtype: with index_topk
4096 (every entry kept), float32 cosine min 0.99862, mean 0.99969, top-1 94.7%, bfloat16 min
0.99738, top-1 88.6%, both 100% where the reference's best two logits differ by > 0.05
(largest margin at a disagreement 0.0078); with index_topk 6 (the top-6 over fp8 keys can
swap near-tied entries), float32 cosine min 0.968, mean 0.997, top-1 90.2%, bfloat16 min
0.990, top-1 89.4%, both 100% where the margin is > 0.05. Thresholds: cosine mean >= 0.995 and min >= 0.95, top-1 >= 85%
overall and 100% where the margin is > 0.05. Slow (~1-2 min each on a shared 2-core VM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.latent_format import cache_head
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.fixtures.random import RANDOM_V4, save_random_v4
from pdserve.kernels import fp8_ds_v4
from tests.test_fp8_kv import agreement

transformers = pytest.importorskip("transformers")

FP8_V4: dict[str, Any] = {"head_dim": 128, "partial_rotary_factor": 0.5, "index_head_dim": 128}
KV = 64 + 2 * 64 + 1 + 1  # fp8 nope, bf16 rope, a scale byte, a pad byte
ROW = KV + (4 * 128 + 4 * 128) * 4  # then CSA's projections in float32 (the widest row)
BLOCK = 16
PER_GROUP = 8  # blocks of each sequence in each group: 8 x 16 tokens, entries of 4 or 16


@pytest.fixture(scope="module")
def v4_fp8_model(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("fp8dsv4") / "v4"
    return save_random_v4(root, tokenizer_from=model_dir, **FP8_V4)


def _v4_config(**overrides: Any) -> ModelConfig:
    raw = transformers.DeepseekV4Config(**{**RANDOM_V4, **overrides}).to_dict()
    return ModelConfig.from_dict(raw)


def test_v4_flash_kv_row_is_584_bytes_and_the_slot_its_widest_row() -> None:
    assert fp8_ds_v4.kv_bytes(512, 64) == 584  # vLLM's head_bytes: 448 + 128 + 7 + 1
    flash = _v4_config(head_dim=512, partial_rotary_factor=0.125, index_head_dim=128)
    # rows: the record, then CSA's projections (4 x 512 + 4 x 128) in bf16; entries: the
    # record and the key's 132 bytes (716) fit in the slot of one width
    assert cache_head(flash, "bfloat16", "float8_e4m3fn") == (584 + 2560 * 2, 1, "uint8")
    assert cache_head(flash, "bfloat16") == (3072, 1, "bfloat16")  # 6,144 bytes
    assert cache_head(_v4_config(**FP8_V4), "float32", "float8_e4m3fn") == (ROW, 1, "uint8")
    with pytest.raises(ValueError, match="head_dim - rope_dim to be a multiple of 64.* = 24"):
        cache_head(_v4_config(), "float32", "float8_e4m3fn")
    with pytest.raises(ValueError, match="index_head_dim to be a multiple of 128.* is 16"):
        cache_head(_v4_config(head_dim=128, partial_rotary_factor=0.5), "float32", "float8_e4m3fn")


def test_kv_record_bytes_round_trip() -> None:
    """nope fp8 at [0, 448), rope bf16 at [448, 576), a ue8m0 exponent byte per 64 values at
    [576, 583), a zero pad byte: V4-Flash's 584, and back within fp8's rounding."""
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(3, 512, generator=gen) * torch.tensor([[1e-6], [1.0], [500.0]])
    record = fp8_ds_v4.quantize_kv(kv, 64)
    assert record.dtype == torch.uint8 and record.shape == (3, 584)
    assert torch.equal(record[:, 448:576].contiguous().view(torch.bfloat16), kv[:, 448:].bfloat16())
    assert (record[:, 583] == 0).all()
    exponents = record[:, 576:583].float() - 127  # [3, 7]
    amax = kv[:, :448].reshape(3, 7, 64).abs().amax(-1).clamp_min(1e-4)
    assert (torch.exp2(exponents) >= amax / 448).all() and (
        torch.exp2(exponents) < 2 * amax / 448
    ).all()
    values = record[:, :448].contiguous().view(torch.float8_e4m3fn).float().view(3, 7, 64)
    nope = (values * torch.exp2(exponents)[..., None]).view(3, 448)
    back = fp8_ds_v4.dequantize_kv(record, 512, 64)
    assert torch.equal(back[:, :448], nope) and torch.equal(
        back[:, 448:], kv[:, 448:].bfloat16().float()
    )
    torch.testing.assert_close(nope[1:], kv[1:, :448], rtol=0.07, atol=1e-12)
    assert nope[0].abs().max() < 1e-5  # a tile below the 1e-4 floor: its fp8 values round down


def test_rows_and_entries_pack_and_unpack() -> None:
    """A per-token row keeps its projections' bytes exactly; an entry's key takes fp8."""
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(5, 128 + 96, generator=gen)
    packed = fp8_ds_v4.pack_rows(rows, 128, 64, width=KV + 96 * 4 + 10)
    assert packed.shape == (5, KV + 394) and (packed[:, KV + 384 :] == 0).all()
    back = fp8_ds_v4.unpack_rows(packed, 128, 64, torch.float32)  # [5, 128 + 98]
    assert torch.equal(back[:, 128:224], rows[:, 128:])  # unquantized, bit for bit
    assert torch.equal(back[:, :128], fp8_ds_v4.dequantize_kv(packed[:, :KV], 128, 64))
    entries = torch.randn(5, 128 + 128, generator=gen)
    packed = fp8_ds_v4.pack_entries(entries, 128, 64, width=ROW)
    back = fp8_ds_v4.unpack_entries(packed, 128, 64, 128, torch.float32)
    torch.testing.assert_close(back, entries, rtol=0.07, atol=0.02)
    assert fp8_ds_v4.unpack_entries(packed, 128, 64, 0, torch.float32).shape == (5, 128)
    # one row alone: its key's scale starts at byte 322 of the gathered bytes
    one = fp8_ds_v4.unpack_entries(packed[2:3], 128, 64, 128, torch.float32)
    assert torch.equal(one, back[2:3])
    assert fp8_ds_v4.unpack_entries(packed[:0], 128, 64, 128, torch.float32).shape == (0, 256)
    assert fp8_ds_v4.unpack_rows(packed[:0], 128, 64, torch.float32).shape[0] == 0
    with pytest.raises(ValueError, match="row of 326 bytes in a 300-byte page"):
        fp8_ds_v4.pack_entries(entries, 128, 64, width=300)


def _runner(
    path: Path, kv_cache_dtype: str | None, dtype: str = "float32", device: str = "cpu"
) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_dir(path),
        path,
        device=device,
        dtype=dtype,
        block_size=BLOCK,
        num_blocks=240,
        kv_cache_memory_gb=0.1,
        gpu_memory_utilization=0.5,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=512,
    )


def test_fp8_v4_cache_holds_the_rows_bytes(v4_fp8_model: Path) -> None:
    runner = _runner(v4_fp8_model, "float8_e4m3fn")
    assert runner.kv_cache.dtype == torch.uint8 and runner.layout.head_dim == ROW


def _v4_step_logits(
    runner: ModelRunner, prompts: list[list[int]], forced: list[list[int]] | None, steps: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """tests/test_fp8_kv.py's ``_step_logits`` with a block table per KV cache group."""
    num = len(runner.group_rates)
    tables = [
        [list(range(1 + PER_GROUP * (num * s + g), 1 + PER_GROUP * (num * s + g + 1)))
         for g in range(num)]
        for s in range(len(prompts))
    ]  # fmt: skip

    def seq(s: int, ids: list[int], start: int) -> ScheduledSeq:
        return ScheduledSeq(f"r{s}", ids, start, tables[s][0], True, group_block_ids=tables[s][1:])

    # copies: a CUDA-graph replay's logits are its graph's buffer, overwritten by the next
    logits = [
        runner.execute(StepPlan([seq(s, p, 0) for s, p in enumerate(prompts)])).float().clone()
    ]
    fed: list[list[int]] = [[] for _ in prompts]
    for i in range(steps):
        seqs = []
        for s, prompt in enumerate(prompts):
            token = forced[s][i] if forced else int(logits[-1][s].argmax())
            fed[s].append(token)
            seqs.append(seq(s, [token], len(prompt) + i))
        logits.append(runner.execute(StepPlan(seqs)).float().clone())
    return torch.stack(logits), fed


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("index_topk", [4096, 6], ids=["every-entry", "top6"])
def test_fp8_v4_logits_track_the_auto_cache_every_decode_step(
    tmp_path: Path, model_dir: Path, index_topk: int, dtype: str
) -> None:
    path = save_random_v4(
        tmp_path / "v4", tokenizer_from=model_dir, **FP8_V4, index_topk=index_topk
    )
    gen = torch.Generator().manual_seed(15)
    vocab = ModelConfig.from_dir(path).vocab_size
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (40, 55, 70, 90)]
    ref, tokens = _v4_step_logits(_runner(path, None, dtype), prompts, None, 32)
    got, _ = _v4_step_logits(_runner(path, "float8_e4m3fn", dtype), prompts, tokens, 32)
    ref, got = ref.flatten(0, 1), got.flatten(0, 1)  # [positions, vocab]
    cosine, agree, clear = agreement(ref, got, f"index_topk {index_topk} {dtype}")
    assert cosine.mean().item() >= 0.995 and cosine.min().item() >= 0.95
    assert agree.float().mean().item() >= 0.85
    assert agree[clear].all()


ENGINE = {"block_size": BLOCK, "kv_cache_dtype": "fp8", "kv_cache_memory_gb": 0.05}
TEXTS = [
    "Monday, Tuesday,",
    "The quick brown fox jumps over the lazy dog. " * 12,  # ~120 tokens: entries of 4 and 16
]


def test_fp8_v4_engine_generates_through_chunks_and_a_prefix_hit(v4_fp8_model: Path) -> None:
    """The engine on the fp8 cache: 50-token chunks (not a multiple of 4 or 16), then the same
    prompt from its cached fp8 rows and entries (a prefix hit) gives the same tokens."""
    engine = LLMEngine(EngineConfig(model=str(v4_fp8_model), **ENGINE, max_num_batched_tokens=50))
    assert engine.runner.layout.dtype == "uint8"
    prompt = engine.tokenizer.encode(TEXTS[1])
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    first = engine.generate([prompt], sampling)[0].token_ids
    before = engine.scheduler.num_computed_tokens
    assert engine.generate([prompt], sampling)[0].token_ids == first
    assert engine.scheduler.num_computed_tokens - before < len(prompt) // 2


@pytest.mark.slow
@pytest.mark.parametrize("flags", [{}, {"pcp": 2}], ids=["tp1", "pcp2"])
def test_fp8_v4_disaggregated_pull_gives_the_monolithic_fp8_tokens(
    tmp_path: Path, v4_fp8_model: Path, flags: dict[str, int]
) -> None:
    """Prefill (TP 1, or PCP 2: each rank packs the same gathered rows and pools the same
    entries) -> NIXL -> decode TP 1, both on the fp8 cache: the monolithic fp8 engine's
    tokens, every pool full after, and the decode pulled ROW bytes a slot."""
    from tests.e2e import deployment
    from tests.test_fp8_mla_serving import _serve
    from tests.test_serving import assert_pools_full, metrics, total

    mono = LLMEngine(EngineConfig(model=str(v4_fp8_model), **ENGINE))
    prompts = [mono.tokenizer.encode(t) for t in TEXTS]
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in mono.generate(prompts, sampling)]
    with deployment(tmp_path, v4_fp8_model, engine=ENGINE, **flags) as dep:
        got = _serve(dep.cfg.front_address, prompts)
        snap = metrics(dep.url)
        assert_pools_full(dep.url)
    assert got == want
    pulled = total(snap, "pdserve:kv_transfer_bytes_total", "decode")
    assert pulled > 0 and pulled % (BLOCK * ROW) == 0  # whole fp8 pages of every group

"""Model families users deploy, against Hugging Face transformers token for token.

Each checkpoint is built by transformers' own config and model classes (random weights,
float32, the embedded model's tokenizer), saved with save_pretrained, then run greedily by
our engine and by HF ``generate`` on prompts of ~6 to ~900 tokens. The families differ in
the switches ModelConfig reads (common/model/checkpoint/config.py): rope scaling and a head_dim of
128, q/k/v bias with tied embeddings, a window on every layer, a window on some layers
only (Qwen2's use_sliding_window + max_window_layers), and Qwen3's per-head q/k RMSNorm
with a head_dim independent of hidden/heads.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.kv_groups import page_groups, page_layers
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.model.checkpoint.config import SLIDING_ATTENTION, ModelConfig

transformers = pytest.importorskip("transformers")

NUM_TOKENS = 16
PROMPT_LENGTHS = (6, 100, 900)
GGUF_VOCAB = 1024
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "llama",
        {
            "hidden_size": 256,
            "intermediate_size": 256,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 128,
            "num_hidden_layers": 2,
            "rope_scaling": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        },
    ),
    "qwen2": (
        "qwen2",
        {**SMALL, "num_key_value_heads": 2, "num_hidden_layers": 2, "tie_word_embeddings": True},
    ),
    "mistral": (
        "mistral",
        {**SMALL, "num_key_value_heads": 2, "num_hidden_layers": 2, "sliding_window": 16},
    ),
    "qwen2-sliding": (
        "qwen2",
        {
            **SMALL,
            "num_key_value_heads": 2,
            "num_hidden_layers": 4,
            "use_sliding_window": True,
            "sliding_window": 16,
            "max_window_layers": 2,
        },
    ),
    "qwen3": (
        "qwen3",
        {
            **SMALL,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "head_dim": 32,
            "attention_bias": True,  # q/k/v and o_proj biases, the latter row-parallel under TP
        },
    ),
}


def build(root: Path, family: str) -> Path:
    from pdserve.common.model.fixtures.random import save_random_model

    model_type, config = FAMILIES[family]
    return save_random_model(
        root / family, model_type, max_position_embeddings=4096, seed=1, **config
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: build(root, family) for family in FAMILIES}


def sentence_prompts(model_dir: Path, lengths: tuple[int, ...], repeats: int) -> list[list[int]]:
    """Prompts of ``lengths`` tokens cut from one sentence said ``repeats`` times."""
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer

    text = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * repeats
    ids = Tokenizer.from_dir(model_dir).encode(text)
    return [ids[:n] for n in lengths]


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    return sentence_prompts(model_dir, PROMPT_LENGTHS, 120)


def hf_greedy(model_dir: Path, prompts: list[list[int]], num: int = NUM_TOKENS) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=num, do_sample=False, top_p=None, top_k=None
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def engine_greedy(model_dir: Path, prompts: list[list[int]], **engine: Any) -> list[list[int]]:
    config = EngineConfig(model=str(model_dir), kv_cache_memory_gb=0.05, **engine)
    eng = LLMEngine(config)
    outs = eng.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS))
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    return [o.token_ids for o in outs]


def greedy_under_preemption(
    model_dir: Path, batch: list[list[int]], num_kv_blocks: int, **engine: Any
) -> tuple[LLMEngine, list[list[int]]]:
    """Greedy tokens of ``batch`` in blocks of 16 too few for it at once (no prefix cache
    to share them): some sequences are preempted and their rows recomputed on resume.
    ``engine``: more EngineConfig fields (device, dtype)."""
    engine_ = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            block_size=16,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=64,
            enable_prefix_caching=False,
            **engine,
        )
    )
    got = engine_.generate(batch, SamplingParams(max_tokens=NUM_TOKENS))
    return engine_, [o.token_ids for o in got]


def preemption_gives_the_reference(
    model_dir: Path,
    prompts: list[list[int]],
    reference: list[list[int]],
    num_kv_blocks: int,
    **engine: Any,
) -> None:
    """The first prompt and the second twice under ``greedy_under_preemption``: some
    sequence is preempted, the tokens are ``reference``'s, every block comes back."""
    batch = [prompts[0], prompts[1], prompts[1]]
    engine_, got = greedy_under_preemption(model_dir, batch, num_kv_blocks, **engine)
    assert got == [reference[0], reference[1], reference[1]]
    assert engine_.scheduler.num_preemptions > 0
    assert engine_.pool.num_free_blocks == engine_.pool.num_blocks


def test_config_reads_each_family_as_transformers_does(checkpoints: dict[str, Path]) -> None:
    for family, path in checkpoints.items():
        cfg = ModelConfig.from_dir(path)
        hf = transformers.AutoConfig.from_pretrained(path)
        kinds = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
        if cfg.model_type == "mistral":  # MistralAttention windows every layer
            kinds = ["sliding_attention"] * hf.num_hidden_layers
        want = tuple(hf.sliding_window if k == SLIDING_ATTENTION else None for k in kinds)
        assert cfg.layer_windows == want, family
        assert cfg.head_dim == getattr(hf, "head_dim", None) or hf.hidden_size // 4
    mix = ModelConfig.from_dir(checkpoints["qwen2-sliding"])
    assert mix.layer_windows == (None, None, 16, 16)
    qwen3 = ModelConfig.from_dir(checkpoints["qwen3"])
    assert qwen3.qk_norm and qwen3.head_dim == 32 != qwen3.hidden_size // 4
    assert not ModelConfig.from_dir(checkpoints["qwen2"]).qk_norm


# The new switches run in the fast tier; the families that only re-check old paths, slow.
FAST = ("qwen2-sliding", "qwen3")


@pytest.mark.parametrize(
    "family", [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
)
def test_greedy_tokens_identical_to_transformers(
    checkpoints: dict[str, Path], prompts: list[list[int]], family: str
) -> None:
    want = hf_greedy(checkpoints[family], prompts)
    assert engine_greedy(checkpoints[family], prompts) == want


@pytest.mark.parametrize(
    "family", ["mistral", pytest.param("qwen2-sliding", marks=pytest.mark.slow)]
)
def test_windows_across_small_blocks_and_chunked_prefill(
    checkpoints: dict[str, Path], prompts: list[list[int]], family: str
) -> None:
    """Blocks of 16 (one window) and 100-token chunks: windows straddle blocks and chunks."""
    want = hf_greedy(checkpoints[family], prompts)
    got = engine_greedy(checkpoints[family], prompts, block_size=16, max_num_batched_tokens=100)
    assert got == want


@pytest.mark.slow
def test_pdserve_generate_raw_on_qwen3(checkpoints: dict[str, Path], model_dir: Path) -> None:
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer

    text = "The quick brown fox jumps over the lazy dog."
    tok = Tokenizer.from_dir(model_dir)
    [want] = hf_greedy(checkpoints["qwen3"], [tok.encode(text)])
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "generate", "--raw", "--prompt", text]
        + ["--max-tokens", str(NUM_TOKENS), "--model", str(checkpoints["qwen3"])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == tok.decode(want) + "\n"


DISAGGREGATED = [
    ("qwen3", {"pcp": 2}),
    ("qwen3", {"prefill_tp": 2, "decode_tp": 1}),
    ("qwen2-sliding", {"pcp": 2}),
    ("qwen2-sliding", {"prefill_tp": 2, "decode_tp": 1}),
    # every layer windowed: decode returns the pulled blocks that leave the window
    ("mistral", {"pcp": 2}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "flags"), DISAGGREGATED)
def test_disaggregated_pcp_and_tp_through_the_openai_api(
    tmp_path: Path,
    checkpoints: dict[str, Path],
    model_dir: Path,
    family: str,
    flags: dict[str, int],
) -> None:
    """`pdserve up` with --pcp 2, or --prefill-tp 2 --decode-tp 1: HF's tokens."""
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer
    from tests.e2e import deployment
    from tests.test_serving import assert_pools_full, metrics, post, total

    tok = Tokenizer.from_dir(model_dir)
    texts = ["Monday, Tuesday,", "The quick brown fox jumps over the lazy dog. " * 40]
    want = [tok.decode(t) for t in hf_greedy(checkpoints[family], [tok.encode(x) for x in texts])]
    with deployment(tmp_path, checkpoints[family], **flags) as dep:
        for text, expected in zip(texts, want, strict=True):
            body = {"prompt": text, "max_tokens": NUM_TOKENS, "temperature": 0}
            status, answer = post(dep.url, "/v1/completions", body)
            assert status == 200, answer
            assert answer["choices"][0]["text"] == expected
        assert_pools_full(dep.url)
        cfg = ModelConfig.from_dir(checkpoints[family])
        if any(cfg.layer_windows):  # of a sliding group only the blocks its window reaches
            block = dep.cfg.engine.block_size
            groups = page_groups(cfg.layer_windows)
            lengths = [len(tok.encode(x)) for x in texts]
            published = sum(
                -(-n // block) - g.num_blocks_outside(n, block) for n in lengths for g in groups
            )
            # bytes of one block of one layer; a block of the pool holds page_layers layers
            layer_block = 2 * cfg.num_key_value_heads * block * cfg.head_dim * 4
            pulled = total(metrics(dep.url), "pdserve:kv_transfer_bytes_total", "decode")
            assert pulled == published * page_layers(groups) * layer_block
            # less than a cache keeping every layer's every block would move, by the
            # blocks behind each sliding layer's window (no group here has unused slots)
            everything = sum(-(-n // block) for n in lengths) * cfg.num_hidden_layers
            dropped = sum(
                g.num_blocks_outside(n, block) * len(g.layers) for n in lengths for g in groups
            )
            assert dropped > 0 and pulled == (everything - dropped) * layer_block


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_gguf_of_each_family_runs_as_its_checkpoint(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model_dir: Path,
    prompts: list[list[int]],
    model_type: str,
) -> None:
    """`--model FILE.gguf`: converted by transformers' GGUF reader, HF's tokens again.
    (head_dim 128: transformers reads no key_length for qwen3 and assumes its default.)
    The vocabulary is the embedded tokenizer's first GGUF_VOCAB ids (a full one costs
    transformers seconds to parse, three times a load)."""
    pytest.importorskip("gguf")
    from pdserve.common.model.fixtures.random import save_random_model
    from tests.gguf_writer import write_gguf

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    config = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 2}
    checkpoint = save_random_model(
        tmp_path / model_type,
        model_type,
        num_key_value_heads=1,
        num_hidden_layers=2,
        head_dim=128,
        max_position_embeddings=4096,
        tokenizer_from=model_dir,  # converted once a session, not again in this cache
        vocab_size=GGUF_VOCAB,
        **config,
    )
    gguf_file = write_gguf(checkpoint, tmp_path / f"{model_type}.gguf")
    ids = [[t % GGUF_VOCAB for t in p] for p in prompts[:2]]
    want = hf_greedy(checkpoint, ids)
    assert engine_greedy(gguf_file, ids) == want

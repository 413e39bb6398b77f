"""The CUDA path end to end (GPU machine): KV in VRAM, NIXL moving VRAM between a prefill
and a decode process sharing one GPU, outputs token-identical to the monolithic engine."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    from pdserve.common.random_model import save_random_llama

    return save_random_llama(
        tmp_path_factory.mktemp("m") / "llama", num_layers=4, hidden_size=512, num_heads=8,
        num_kv_heads=4, intermediate_size=1024, tokenizer_from=model_dir,
    )


def test_vram_pulls_match_the_monolithic_engine(tmp_path: Path, random_model: Path) -> None:
    from pdserve.common.config import EngineConfig
    from pdserve.common.engine import LLMEngine
    from pdserve.common.sampling import SamplingParams
    from pdserve.services.router.client import Client
    from tests.e2e import deployment

    prompts = [[(i * 31 + j * 7) % 40000 + 5 for j in range(n)] for i, n in enumerate([1, 63, 64, 65, 300, 1000])]
    mono = LLMEngine(EngineConfig(model=str(random_model), device="cuda", gpu_memory_utilization=0.2))
    want = [c.token_ids for c in mono.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
    del mono
    torch.cuda.empty_cache()
    dep = deployment(tmp_path, random_model, device="cuda", engine={"gpu_memory_utilization": 0.25})
    with dep, Client(dep.cfg.front_address) as client:
        got = [client.generate(prompt_token_ids=p, max_tokens=12, ignore_eos=True, temperature=0.0).token_ids for p in prompts]
    assert got == want

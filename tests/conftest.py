"""Shared fixtures.

real_model_dir converts the embedded GGUF into the real cache (~/.cache/pdserve/models, or
$PDSERVE_CACHE_DIR), not a per-run temp dir: the ~20 s conversion then happens once
per machine and later test runs start in milliseconds. model_dir is a tiny random Llama
with the embedded model's tokenizer, for every test the trained weights add nothing to.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.model.checkpoint.files import resolve_model
from pdserve.common.runtime import ports
from tests.fault_suite import fault_report  # noqa: F401 (a session fixture)
from tests.hostile_tools import hostile_dep, hostile_hold, hostile_report  # noqa: F401 (session fixtures)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (scripts/test.sh runs each lane on workers), each worker
    takes its deployments' ports from its own share of the range below the ephemeral one,
    and computes on one thread: with a thread per core in each worker (and the services'
    processes beside them) torch's OpenMP threads spin waiting for cores the others hold,
    which made in-process tests take 3 to 7 times their CPU time alone. The processes a
    worker starts (``pdserve generate``, benchmarks) get one OpenMP thread too
    (OMP_NUM_THREADS; a test's own setting wins): ``pdserve generate`` on the embedded
    model took 11 s of CPU beside the other workers, 3.8 s alone."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        index, count = int(worker[2:]), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
        low, high = ports.default_port_range()
        share = (high - low) // count
        ports.set_port_range(low + index * share, low + (index + 1) * share)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The embedded model (SmolLM2-135M-Instruct), for tests of what trained weights do:
    answers, EOS, tool calls, the GGUF's own logits, token identity with transformers.
    PDSERVE_TEST_MODEL: a model directory to use instead (the GPU machine, which cannot
    carry the embedded model, points it at a small random model with the same tokenizer)."""
    return resolve_model(os.environ.get("PDSERVE_TEST_MODEL") or None)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    """A random Llama of 2 layers (hidden 256, GQA 4:2) with the embedded model's tokenizer
    and chat template, written once a session: the model of every test where trained weights
    add nothing (serving, transfers, PCP and TP identity, faults, the API's shapes). Each
    service process loads and runs it in a fraction of the real model's time (the slow lane:
    ~710 -> ~510 s on 2 cores). PDSERVE_TEST_MODEL replaces it too."""
    if os.environ.get("PDSERVE_TEST_MODEL"):
        return real_model_dir
    from pdserve.common.model.fixtures.random import save_random_llama

    return save_random_llama(
        tmp_path_factory.mktemp("tiny") / "llama",
        num_layers=2,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
        max_position_embeddings=8192,
        tokenizer_from=real_model_dir,
    )


@pytest.fixture(scope="session")
def gpu_llama(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """A random 4-layer Llama (hidden 512, GQA 8:4) with the test model's tokenizer: the
    GPU tests' model, written once a session."""
    from pdserve.common.model.fixtures.random import save_random_llama

    return save_random_llama(
        tmp_path_factory.mktemp("m") / "llama",
        num_layers=4,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1024,
        tokenizer_from=model_dir,
    )


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)

"""Shared fixtures.

model_dir converts the embedded GGUF into the real cache (~/.cache/pdserve/models, or
$PDSERVE_CACHE_DIR), not a per-run temp dir: the ~20 s conversion then happens once
per machine and later test runs start in milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.common.model_files import resolve_model


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)

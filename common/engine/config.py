"""Engine configuration: a frozen Struct, validated once. Keys keep vLLM's names."""

from __future__ import annotations

import msgspec

from pdserve.common.engine.fair_batch import parse_mode
from pdserve.common.engine.spec_decode.config import SpeculativeConfig
from pdserve.common.errors import PdserveError

DEVICES = ("cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# KV cache storage (vLLM's --kv-cache-dtype): "auto" stores K/V in the model dtype, "fp8"
# in float8 e4m3 with per-tensor scales (common/engine/kv_quant.py, docs/models.md).
KV_CACHE_DTYPES = ("auto", "fp8")


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None  # HF directory or GGUF file; None: the embedded default
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    block_size: int = 64
    num_kv_blocks: int | None = None  # None: derived from the memory settings below
    kv_cache_memory_gb: float = 1.0  # CPU: bytes of DRAM for the KV cache
    gpu_memory_utilization: float = 0.5  # CUDA: share of the device this engine may use
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # GiB of host memory for a tier under the prefix cache (common/engine/host_tier.py):
    # blocks the device pool evicts are kept there and copied back up on a prefix hit;
    # 0: no tier
    kv_host_cache_gb: float = 0.0
    # A prefill's blocks its tier also holds, as decode reads them: "device" from the
    # prefill's device cache (the prefill brought them up at PCIe speed for its own step:
    # staged through its GPU, decode's READ a VRAM one; held for the lease), "host" from
    # the tier's DRAM (KVHandle.host_slots: the device blocks free at once, the READ a DRAM
    # one, slow into a GPU, issue #48), "auto": device on CUDA, host on CPU
    kv_host_tier_serve: str = "auto"
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # Storage order of the KV cache (common/engine/kv_layout.py): "head" suits readers of a head
    # slice (decode TP != prefill TP), "block" readers of every head; "auto" lets the
    # deployment choose from its TP sizes (a lone engine takes "head").
    kv_order: str = "auto"
    # CUDA: decode steps of up to this many sequences replay captured graphs
    # (common/engine/cuda_graphs.py); larger ones, and every step on CPU, run eagerly.
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = 64
    # CPU, float32: every GEMM of the GQA layers and the LM head runs on a copy of its weight
    # that oneDNN reordered at load (common/model/layers/linear.py): 1.2-1.7x faster GEMMs at decode
    # batch sizes, twice the memory of those weights; false keeps plain F.linear
    cpu_weight_prepack: bool = True
    # Schedule and launch each step before the last one's tokens reach the host
    # (common/engine/async_steps.py); None: on for CUDA, off on CPU (where the host's work
    # and the forward share the cores)
    async_scheduling: bool | None = None
    # Fair decode batches (#49, common/engine/fair_batch.py): while more than one client
    # decodes, step their sequences in batches no bigger than the smallest that keeps ~90%
    # of the measured decode throughput (CPU: saturates early; GPU: never engages);
    # "auto" (from the engine's own step times), "off", or N (a fixed cap)
    fair_decode_batch: str | int = "auto"
    # Speculative decoding of decode steps (common/engine/spec_decode/); prefill ignores it.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise PdserveError(
                f"unknown device {self.device!r}; choose one of {', '.join(DEVICES)}"
            )
        if self.dtype not in DTYPES:
            raise PdserveError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise PdserveError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; "
                f"choose one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise PdserveError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "cuda_graph_max_batch"):
            if getattr(self, name) < 1:
                raise PdserveError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_order not in ("auto", "head", "block"):
            raise PdserveError(f"kv_order must be auto, head or block, got {self.kv_order!r}")
        if self.kv_host_cache_gb < 0:
            raise PdserveError(
                f"kv_host_cache_gb must be 0 (no host tier) or more, got {self.kv_host_cache_gb}"
            )
        if self.kv_host_tier_serve not in ("auto", "device", "host"):
            raise PdserveError(
                f"kv_host_tier_serve must be auto, device or host, got {self.kv_host_tier_serve!r}"
            )
        try:
            parse_mode(self.fair_decode_batch)
        except ValueError as exc:
            raise PdserveError(str(exc)) from None
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise PdserveError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")

    @property
    def serves_host_tier(self) -> bool:
        """Whether a prefill hands decode its tier's slots (``kv_host_tier_serve``)."""
        if self.kv_host_tier_serve == "auto":
            return self.device == "cpu"
        return self.kv_host_tier_serve == "host"

    @property
    def is_async_scheduling(self) -> bool:
        if self.async_scheduling is None:
            return self.device == "cuda"
        return self.async_scheduling

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device == "cuda" else "float32"

    @property
    def kv_cache_torch_dtype_name(self) -> str:
        """The torch dtype of the KV cache: the model's for "auto", float8_e4m3fn for fp8."""
        return "float8_e4m3fn" if self.kv_cache_dtype == "fp8" else self.torch_dtype_name

"""What the kernel tests share (test_kernels*.py, test_mla_kernels.py, test_kernels_v4*.py,
test_dsv4_fused.py): the devices the Triton kernels run on (the GPU, or the CPU through
Triton's interpreter), tolerances, the ``device`` / ``ops`` / ``gen`` fixtures (imported as
``*_fixture``), the interpreter's index fix and ``triton_module`` (an ``ops`` fixture's body),
and ``Paged``: random K/V in a NaN-poisoned cache under shuffled block tables.
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch

from pdserve.common.engine.kv_layout import LOGICAL_FROM_STORAGE
from pdserve.kernels import reference

INTERPRET = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")
NUM_LAYERS, LAYER = 3, 1  # the kernels get cache[:, LAYER], a strided view
TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}  # ||out - ref|| / ||ref||
NAN = float("nan")

TRITON_DEVICES = [
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET=1 would interpret the GPU run"),
        ],
    ),
    pytest.param(
        "cpu",
        id="interp",
        marks=[
            pytest.mark.interp,
            pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to interpret on CPU"),
        ],
    ),
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
WINDOWS = [pytest.param(None, id="full"), pytest.param(24, id="win24")]


@pytest.fixture(params=TRITON_DEVICES, name="device")
def device_fixture(request) -> str:
    return request.param


@pytest.fixture(name="ops")
def ops_fixture(device):
    return pytest.importorskip("pdserve.kernels.triton_ops")


def fix_interpreter_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.6's interpreter turns a scalar into a loop bound with ``int(array)``, which
    numpy >= 2.4 refuses for its shape-(1,) scalars (tests/test_kernels.py's interp tests
    fail the same way): convert through ``.item()`` instead."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)


def triton_module(name: str, device: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """``pdserve.kernels.<name>`` for a test on ``device`` (the interpreter's index fix on
    CPU): the body of the ``ops`` fixture of the MLA and V4 kernel tests."""
    if device == "cpu":
        fix_interpreter_index(monkeypatch)
    return pytest.importorskip(f"pdserve.kernels.{name}")


@pytest.fixture(name="gen")
def gen_fixture(request) -> torch.Generator:
    """A generator seeded from the test id: random data, different per case, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


class Paged:
    """Sequences of random K/V written into a NaN-poisoned cache under shuffled block tables."""

    def __init__(self, ctx_lens, num_kv_heads, head_dim, block_size, dtype, device, gen):
        blocks = [math.ceil(c / block_size) for c in ctx_lens]
        num_blocks = sum(blocks) + 4  # block 0 and three more are never written
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        # One spare column: the padding (block 0) is there to be read by mistake.
        self.block_tables = torch.zeros(len(ctx_lens), max(blocks) + 1, dtype=torch.int32)
        for s, n in enumerate(blocks):
            self.block_tables[s, :n] = torch.tensor(ids[:n])
            del ids[:n]
        self.context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
        # The real memory order (head-major storage, common/engine/kv_layout.py) seen through the
        # logical view [N, L, 2, H_kv, B, D]: the kernels must follow the strides.
        storage = (num_kv_heads, num_blocks, NUM_LAYERS, 2, block_size, head_dim)
        self.cache = torch.full(storage, NAN, dtype=dtype).permute(LOGICAL_FROM_STORAGE)
        # Un-paged K/V per sequence, [ctx, H_kv, D] float64, as the cache rounds them.
        self.keys, self.values, slots = [], [], []
        for s, ctx in enumerate(ctx_lens):
            for kv in (self.keys, self.values):
                x = torch.randn(ctx, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
                kv.append(x.to(dtype).double())
            pos = torch.arange(ctx)
            block_ids = self.block_tables[s, pos // block_size].long()
            slots.append(block_ids * block_size + pos % block_size)
        reference.write_kv(
            self.cache[:, LAYER], torch.cat(self.keys), torch.cat(self.values), torch.cat(slots)
        )
        self.cache = self.cache.to(device)
        self.block_tables = self.block_tables.to(device)
        self.context_lens = self.context_lens.to(device)
        self.layer = self.cache[:, LAYER]  # [N, 2, H_kv, B, D]


def cpu64(x):
    """A tensor argument moved to CPU, floating point as float64; anything else as is."""
    if not torch.is_tensor(x):
        return x
    return x.cpu().double() if x.is_floating_point() else x.cpu()


def random_q(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, gen):
    """q as the leading heads of a packed qkv row, so its token stride is not H_q * D."""
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    return qkv.to(dtype).to(device)[:, :num_heads]


def triton_engine_greedy_equals_hf(model, model_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The whole ``model`` on the Triton path (PDSERVE_KERNELS=triton; on CPU through the
    interpreter): two prompts batched, 50-token chunks across 16-token blocks, 4 decode
    steps, greedy tokens = transformers'."""
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams
    from tests.test_families import hf_greedy, sentence_prompts

    prompts = sentence_prompts(model_dir, (40, 70), 20)
    reference = hf_greedy(model, prompts, 4)
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    engine = LLMEngine(
        EngineConfig(
            model=str(model), kv_cache_memory_gb=0.05, block_size=16, max_num_batched_tokens=50
        )
    )
    got = engine.generate(prompts, SamplingParams(max_tokens=4))
    assert [o.token_ids for o in got] == reference

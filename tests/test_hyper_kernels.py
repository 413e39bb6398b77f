"""DeepSeek-V4's hyper-connection mixing: the torch reference (kernels/hyper_ref.py) bit for
bit as transformers' ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` on CPU, and the
one-kernel Triton version (kernels/triton_hyper.py) against that reference, through Triton's
interpreter on CPU (``TRITON_INTERPRET=1``) or on the GPU (``-m gpu``, with a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import hyper_ref
from tests.kernel_tools import TRITON_DEVICES, device_fixture  # noqa: F401

HC, HIDDEN, ITERS = 4, 64, 20


def hf_config():  # noqa: ANN201
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "deepseek_v4", hidden_size=HIDDEN, hc_mult=HC, hc_sinkhorn_iters=ITERS, rms_norm_eps=1e-6
    )


def params(
    head: bool, gen: torch.Generator, hidden: int = HIDDEN
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = HC if head else (2 + HC) * HC
    fn = torch.randn(rows, HC * hidden, generator=gen) * 0.3
    base = torch.randn(rows, generator=gen)
    scale = torch.rand(1 if head else 3, generator=gen) + 0.5
    return fn, base, scale


def test_reference_mix_is_transformers_hyper_connection_bit_for_bit() -> None:
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    config = hf_config()
    gen = torch.Generator().manual_seed(0)
    module = hf.DeepseekV4HyperConnection(config)
    fn, base, scale = params(False, gen)
    with torch.no_grad():
        module.fn.copy_(fn), module.base.copy_(base), module.scale.copy_(scale)
    streams = torch.randn(2, 5, HC, HIDDEN, generator=gen)
    want = module(streams)
    got = hyper_ref.mix(streams.flatten(0, 1), fn, base, scale, 1e-6, config.hc_eps, ITERS)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w.flatten(0, 1))


def test_reference_collapse_is_transformers_hyper_head_bit_for_bit() -> None:
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    config = hf_config()
    gen = torch.Generator().manual_seed(1)
    module = hf.DeepseekV4HyperHead(config)
    fn, base, scale = params(True, gen)
    with torch.no_grad():
        module.hc_fn.copy_(fn), module.hc_base.copy_(base), module.hc_scale.copy_(scale)
    streams = torch.randn(3, 4, HC, HIDDEN, generator=gen)
    got = hyper_ref.collapse(streams.flatten(0, 1), fn, base, scale, 1e-6, config.hc_eps)
    assert torch.equal(got, module(streams).flatten(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_triton_mix_and_collapse_match_the_reference(
    device: str, dtype: torch.dtype, tokens: int
) -> None:
    from pdserve.kernels import triton_hyper

    gen = torch.Generator().manual_seed(tokens)
    streams = torch.randn(tokens, HC, HIDDEN, generator=gen).to(dtype)
    fn, base, scale = (t.to(dtype) for t in params(False, gen))
    want = hyper_ref.mix(streams, fn, base, scale, 1e-6, 1e-6, ITERS)
    got = triton_hyper.mix(*(t.to(device) for t in (streams, fn, base, scale)), 1e-6, 1e-6, ITERS)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.cpu().float(), w.float(), **tol)
    fn, base, scale = (t.to(dtype) for t in params(True, gen))
    want_head = hyper_ref.collapse(streams, fn, base, scale, 1e-6, 1e-6)
    got_head = triton_hyper.collapse(
        *(t.to(device) for t in (streams, fn, base, scale)), 1e-6, 1e-6
    )
    torch.testing.assert_close(got_head.cpu().float(), want_head.float(), **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_mix_replays_in_a_cuda_graph_at_the_flash_shape() -> None:
    """V4-Flash's hidden 4096, 4 streams, batch 64, bfloat16: a CUDA graph replay of the
    kernel equals its eager run, and the reference within bf16's rounding."""
    from pdserve.kernels import triton_hyper

    hidden = 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    streams = torch.randn(64, HC, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    fn = (torch.randn(24, HC * hidden, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    base = torch.randn(24, generator=gen, device="cuda").to(torch.bfloat16)
    scale = torch.ones(3, device="cuda", dtype=torch.bfloat16)
    eager = triton_hyper.mix(streams, fn, base, scale, 1e-6, 1e-6, ITERS)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_hyper.mix(streams, fn, base, scale, 1e-6, 1e-6, ITERS)
    graph.replay()
    torch.cuda.synchronize()
    want = hyper_ref.mix(streams, fn, base, scale, 1e-6, 1e-6, ITERS)
    for o, e, w in zip(out, eager, want, strict=True):
        assert torch.equal(o, e)
        torch.testing.assert_close(o.float(), w.float(), rtol=2e-2, atol=2e-2)


def _prev(tokens: int, dtype: torch.dtype, gen: torch.Generator, device: str, hidden: int = HIDDEN):  # noqa: ANN202
    """A previous block's post, comb (from a mix, so comb is near doubly stochastic) and
    output."""
    streams = torch.randn(tokens, HC, hidden, generator=gen).to(dtype)
    fn, base, scale = (t.to(dtype) for t in params(False, gen, hidden))
    post, comb, _ = hyper_ref.mix(streams, fn, base, scale, 1e-6, 1e-6, ITERS)
    out = torch.randn(tokens, hidden, generator=gen).to(dtype)
    return tuple(t.to(device) for t in (post, comb, out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 3, 6])
@pytest.mark.parametrize(
    ("split", "hidden"), [(False, HIDDEN), (True, HIDDEN), (True, 320)],
    ids=["one-launch", "split", "split-3-slices"],
)  # fmt: skip
def test_triton_step_fuses_combine_mix_and_norm_as_the_reference(
    device: str, dtype: torch.dtype, tokens: int, split: bool, hidden: int
) -> None:
    """A layer's glue in one launch (#47), or two at decode sizes (``split``: programs over
    column slices, partial projections and Gram matrices; 320 columns: three slices, the
    last short): the previous block's combine, the mix and the block's RMSNorm equal the
    reference's ops (the combined streams within float32 rounding of the reference's own
    bf16 roundings), with and without each part; the head's form over a subset of rows (the
    logits rows) with the final norm."""
    from pdserve.kernels import triton_hyper

    gen = torch.Generator().manual_seed(10 + tokens)
    streams = torch.randn(tokens, HC, hidden, generator=gen).to(dtype)
    fn, base, scale = (t.to(dtype) for t in params(False, gen, hidden))
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    prev = _prev(tokens, dtype, gen, "cpu", hidden)
    # bfloat16: the kernel rounds where the reference rounds, so values differ by at most
    # one bf16 step where a float32 sum's order tips a rounding (2^-8 relative)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-4}
    dev = [t.to(device) for t in (streams, fn, base, scale)]
    for with_prev in (False, True):
        for with_norm in (False, True):
            p = prev if with_prev else None
            nrm = (weight, 1e-6) if with_norm else None
            want = hyper_ref.step(streams, fn, base, scale, 1e-6, 1e-6, ITERS, prev=p, norm=nrm)
            got = triton_hyper.step(
                *dev, 1e-6, 1e-6, ITERS,
                prev=None if p is None else tuple(t.to(device) for t in p),
                norm=None if nrm is None else (weight.to(device), 1e-6), split=split,
            )  # fmt: skip
            assert (got[0] is None) == (not with_prev)
            for g, w in zip(got, want, strict=True):
                if g is None:
                    continue
                assert g.dtype == w.dtype and g.shape == w.shape
                torch.testing.assert_close(g.cpu().float(), w.float(), **tol)
    # the head: the last layer's combine, the collapse and the final norm of the rows kept
    hfn, hbase, hscale = (t.to(dtype) for t in params(True, gen, hidden))
    rows = torch.arange(tokens - 1, -1, -2)
    want = hyper_ref.step(
        streams, hfn, hbase, hscale, 1e-6, 1e-6, 0, prev=prev, norm=(weight, 1e-6), head=True,
        rows=rows,
    )[3]  # fmt: skip
    got = triton_hyper.step(
        *(t.to(device) for t in (streams, hfn, hbase, hscale)), 1e-6, 1e-6, 0,
        prev=tuple(t.to(device) for t in prev), norm=(weight.to(device), 1e-6), head=True,
        rows=rows.to(device), store=False, split=split,
    )  # fmt: skip
    assert got[0] is None and got[3].shape == (rows.shape[0], hidden)
    torch.testing.assert_close(got[3].cpu().float(), want.float(), **tol)


def test_step_kernel_compiles_for_hopper() -> None:
    """Without a GPU: the glue kernel (and the split form's two) compiles for sm90 in bf16
    at V4-Flash's 4 streams in each form the model launches: a layer's first (the previous
    ffn's combine, mix, norm), the mix alone, the head's (combine over the logits rows,
    collapse, final norm)."""
    triton = pytest.importorskip("triton")
    from tests.kernel_tools import INTERPRET

    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1: kernels are interpreter functions")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdserve.kernels import triton_hyper

    kernel = triton_hyper._hyper_kernel
    ptrs = {"streams_ptr": "*bf16", "rows_ptr": "*i64", "prev_post_ptr": "*fp32",
            "prev_comb_ptr": "*fp32", "prev_out_ptr": "*bf16", "fn_ptr": "*bf16",
            "base_ptr": "*bf16", "scale_ptr": "*bf16", "norm_ptr": "*bf16", "new_ptr": "*bf16",
            "post_ptr": "*fp32", "comb_ptr": "*fp32", "out_ptr": "*bf16", "eps": "fp32",
            "hc_eps": "fp32", "norm_eps": "fp32"}  # fmt: skip
    for head, prev, store, rows, norm in (
        (False, True, True, False, True),
        (False, False, False, False, False),
        (True, True, False, True, True),
    ):
        consts = dict(N=HC, ITERS=20, HEAD=head, PREV=prev, STORE=store, ROWS=rows, NORM=norm,
                      ROUND=1, BLOCK_M=HC if head else 32, BLOCK_H=32)  # fmt: skip
        sig = {n: ptrs.get(n, "constexpr" if n in consts else "i32") for n in kernel.arg_names}
        triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32))
        # the split form (decode sizes): its two kernels
        ptrs["part_ptr"] = "*fp32"
        consts.update(SUB=4)
        for split in (triton_hyper._split_partial_kernel, triton_hyper._split_finish_kernel):
            c = {k: v for k, v in consts.items() if k in split.arg_names}
            if "BLOCK_S" in split.arg_names:
                c["BLOCK_S"] = 32
            sig = {n: ptrs.get(n, "constexpr" if n in c else "i32") for n in split.arg_names}
            triton.compile(ASTSource(split, sig, c), target=GPUTarget("cuda", 90, 32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 64])
def test_triton_step_replays_in_a_cuda_graph_at_the_flash_shape(tokens: int) -> None:
    """V4-Flash's hidden 4096, 4 streams, bfloat16, batch 1 and 64: a layer's fused glue
    (combine, mix, norm) and the head's (combine over half the rows, collapse, final norm)
    replayed from a CUDA graph equal their eager runs, and the reference within two bf16
    roundings (the normed input is rounded from a collapse the kernel and the reference sum in
    different orders: at 8c1e916 on an H100, 3 of 262,144 values 2 ulps apart at batch 64)."""
    from pdserve.kernels import triton_hyper

    hidden = 4096
    gen = torch.Generator(device="cuda").manual_seed(tokens)

    def randn(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * s).to(torch.bfloat16)

    streams = randn(tokens, HC, hidden)
    fn, base, scale = randn(24, HC * hidden, s=0.02), randn(24), randn(3, s=0.1) + 1
    hfn, hbase, hscale = randn(HC, HC * hidden, s=0.02), randn(HC), randn(1, s=0.1) + 1
    weight = randn(hidden, s=0.1) + 1
    post, comb, _ = hyper_ref.mix(streams, fn, base, scale, 1e-6, 1e-6, ITERS)
    prev = (post, comb, randn(tokens, hidden))
    rows = torch.arange(tokens - 1, -1, -2, device="cuda")

    def run() -> tuple[torch.Tensor, ...]:
        layer = triton_hyper.step(
            streams, fn, base, scale, 1e-6, 1e-6, ITERS, prev=prev, norm=(weight, 1e-6)
        )
        head = triton_hyper.step(
            streams, hfn, hbase, hscale, 1e-6, 1e-6, 0, prev=prev, norm=(weight, 1e-6),
            head=True, rows=rows, store=False,
        )[3]  # fmt: skip
        return (*layer, head)

    eager = run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    want = (
        *hyper_ref.step(streams, fn, base, scale, 1e-6, 1e-6, ITERS, prev=prev, norm=(weight, 1e-6)),
        hyper_ref.step(
            streams, hfn, hbase, hscale, 1e-6, 1e-6, 0, prev=prev, norm=(weight, 1e-6),
            head=True, rows=rows,
        )[3],
    )  # fmt: skip
    for o, e, w in zip(out, eager, want, strict=True):
        assert torch.equal(o, e)
        torch.testing.assert_close(o.float(), w.float(), rtol=1.6e-2, atol=1e-3)

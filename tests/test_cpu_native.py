"""kernels/cpu_native.py: the compiled CPU decode and prefill attention against the torch
reference (float64) on NaN-poisoned paged caches, their errors, and the dispatch around
them; each ISA's build (AVX-512, AVX2, portable) that this CPU runs, checked to be the
vector code of its ISA (its compiled-in tag) and correct; the chooser, which falls back to
the reference where a build fails or a kernel is slower."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import cpu_native, pointwise_ref, reference
from tests.kernel_tools import (  # noqa: F401 (gen_fixture: the gen fixture)
    Paged,
    cpu64,
    gen_fixture,
    random_q,
    rel_err,
)

CASES = {  # ctx_lens, H_q, H_kv, D, block size
    "ragged-gqa4": ([1, 15, 16, 17, 90, 700], 8, 2, 64, 16),
    "smollm-shape": ([540, 577, 64, 1], 9, 3, 64, 64),
    "mha-d16": ([33, 2, 129], 4, 4, 16, 16),
    "batch64": ([(37 * i) % 600 + 1 for i in range(64)], 9, 3, 64, 64),
}


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_native.load() is not None, "the CPU kernel did not build (see the log line)"


@pytest.fixture(autouse=True)
def compiled_chosen(monkeypatch):
    """The chooser's timing replaced (a shared machine's timings must not flip which path a
    dispatch test sees): every compiled kernel wins; tests of the chooser inject others."""
    cpu_native.reset_choices()
    monkeypatch.setattr(cpu_native, "measure", lambda kernel, module: (1.0, 2.0))
    yield
    cpu_native.reset_choices()


@pytest.mark.parametrize("window", [None, 24, 100], ids=["full", "win24", "win100"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference(gen, case, window):
    ctx_lens, num_heads, num_kv_heads, head_dim, block = CASES[case]
    paged = Paged(ctx_lens, num_kv_heads, head_dim, block, torch.float32, "cpu", gen)
    q = random_q(len(ctx_lens), num_heads, num_kv_heads, head_dim, torch.float32, "cpu", gen)
    args = (paged.layer, paged.context_lens, paged.block_tables, head_dim**-0.5, window)
    out = cpu_native.decode_attention(q, *args)
    assert out is not None and out.dtype == torch.float32
    assert not out.isnan().any(), "a NaN slot of the cache was read"
    ref = reference.decode_attention(*map(cpu64, (q, *args)))
    assert rel_err(out, ref) < 1e-5


PREFILL_CASES = {  # (context, new query tokens) per sequence, H_q, H_kv, D, block size
    "whole-prompts-gqa3": ([(512, 512), (37, 37), (1, 1)], 9, 3, 64, 64),
    "after-a-prefix": ([(700, 90), (64, 64), (129, 1), (40, 33)], 8, 2, 64, 16),
    "mha-d16-ragged-tiles": ([(33, 33), (100, 67), (2, 2)], 4, 4, 16, 16),
    "d128-gqa8-block24": ([(300, 300), (95, 31)], 16, 2, 128, 24),
}


@pytest.mark.parametrize("window", [None, 24, 100], ids=["full", "win24", "win100"])
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_matches_the_reference(gen, case, window):
    seqs, num_heads, num_kv_heads, head_dim, block = PREFILL_CASES[case]
    paged = Paged([c for c, _ in seqs], num_kv_heads, head_dim, block, torch.float32, "cpu", gen)
    q_lens = torch.tensor([n for _, n in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int()
    q = random_q(int(q_lens.sum()), num_heads, num_kv_heads, head_dim, torch.float32, "cpu", gen)
    args = (paged.layer, cu, paged.context_lens, paged.block_tables, head_dim**-0.5, window)
    out = cpu_native.prefill_attention(q, *args)
    assert out is not None and out.dtype == torch.float32 and out.shape == q.shape
    assert not out.isnan().any(), "a NaN slot of the cache was read"
    ref = reference.prefill_attention(*map(cpu64, (q, *args)))
    assert rel_err(out, ref) < 1e-5


def test_prefill_never_reads_blocks_behind_a_window(gen):
    """Blocks behind every query's window may be back in the pool (NULL_BLOCK, -1)."""
    window, block = 40, 16
    paged = Paged([300, 70], 2, 64, block, torch.float32, "cpu", gen)
    cu = torch.tensor([0, 20, 23], dtype=torch.int32)  # the last 20 and 3 tokens
    q = random_q(23, 4, 2, 64, torch.float32, "cpu", gen)
    tables = paged.block_tables.clone()
    for s, (ctx, q_len) in enumerate([(300, 20), (70, 3)]):
        tables[s, : max(ctx - q_len - window + 1, 0) // block] = -1
    args = (paged.context_lens, tables, 0.125, window)
    out = cpu_native.prefill_attention(q, paged.layer, cu, *args)
    ref = reference.prefill_attention(
        *map(cpu64, (q, paged.layer, cu, paged.context_lens, paged.block_tables, 0.125, window))
    )
    assert out is not None and rel_err(out, ref) < 1e-5


def test_prefill_errors_name_the_problem(gen):
    paged = Paged([40], 2, 64, 16, torch.float32, "cpu", gen)
    q = random_q(40, 2, 2, 64, torch.float32, "cpu", gen)
    cu = torch.tensor([0, 40], dtype=torch.int32)
    tables = paged.block_tables.clone()
    tables[0, 1] = 10_000
    with pytest.raises(RuntimeError, match="block 10000 of sequence 0 is not in the cache"):
        cpu_native.prefill_attention(q, paged.layer, cu, paged.context_lens, tables, 0.1, None)
    with pytest.raises(RuntimeError, match="more queries than context"):
        cpu_native.prefill_attention(
            q, paged.layer, cu, torch.tensor([39]), paged.block_tables, 0.1, None
        )
    odd = random_q(40, 2, 2, 24, torch.float32, "cpu", gen)  # head_dim 24: the reference's
    assert cpu_native.prefill_attention(odd, paged.layer, cu, paged.context_lens,
                                        paged.block_tables, 0.1, None) is None  # fmt: skip


def test_blocks_behind_a_window_are_never_read(gen):
    """Blocks wholly behind the window may be back in the pool (NULL_BLOCK, -1)."""
    paged = Paged([300, 70], 2, 64, 16, torch.float32, "cpu", gen)
    q = random_q(2, 4, 2, 64, torch.float32, "cpu", gen)
    window = 40
    tables = paged.block_tables.clone()
    for s, ctx in enumerate([300, 70]):
        tables[s, : max(ctx - window, 0) // 16] = -1
    out = cpu_native.decode_attention(q, paged.layer, paged.context_lens, tables, 0.125, window)
    ref = reference.decode_attention(
        *map(cpu64, (q, paged.layer, paged.context_lens, paged.block_tables, 0.125, window))
    )
    assert out is not None and rel_err(out, ref) < 1e-5


def test_a_block_outside_the_cache_is_an_error_not_a_crash(gen):
    paged = Paged([40], 2, 64, 16, torch.float32, "cpu", gen)
    q = random_q(1, 4, 2, 64, torch.float32, "cpu", gen)
    tables = paged.block_tables.clone()
    tables[0, 1] = paged.layer.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="not in the cache"):
        cpu_native.decode_attention(q, paged.layer, paged.context_lens, tables, 0.125, None)
    short = paged.block_tables[:, :1]  # 40 tokens need 3 blocks
    with pytest.raises(RuntimeError, match="more tokens than its block table"):
        cpu_native.decode_attention(q, paged.layer, paged.context_lens, short, 0.125, None)


def test_dispatch(monkeypatch, gen):
    """float32 on CPU takes the kernel; PDSERVE_KERNELS=torch, bf16 and an unbuildable kernel
    take the reference, bit for bit."""
    paged = Paged([9, 200], 1, 16, 16, torch.float32, "cpu", gen)
    q = torch.randn(2, 2, 16, generator=gen)
    args = (q, paged.layer, paged.context_lens, paged.block_tables, 0.25)
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    ref = reference.decode_attention(*args)
    native = kernels.decode_attention(*args)
    assert torch.equal(native, cpu_native.decode_attention(*args, None))
    assert rel_err(native, ref) < 1e-5
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert torch.equal(kernels.decode_attention(*args), ref)
    assert kernels.prepare_cpu() is False
    monkeypatch.delenv(kernels.ENV_VAR)
    assert cpu_native.decode_attention(q.bfloat16(), *args[1:], None) is None
    monkeypatch.setattr(cpu_native, "load", lambda: None)
    assert torch.equal(kernels.decode_attention(*args), ref)


def test_prefill_dispatch(monkeypatch, gen):
    """Prefill likewise: the kernel for float32 on CPU, the reference bit for bit otherwise."""
    paged = Paged([9, 200], 1, 16, 16, torch.float32, "cpu", gen)
    q = torch.randn(9 + 50, 2, 16, generator=gen)
    cu = torch.tensor([0, 9, 59], dtype=torch.int32)
    args = (q, paged.layer, cu, paged.context_lens, paged.block_tables, 0.25)
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    ref = reference.prefill_attention(*args)
    native = kernels.prefill_attention(*args)
    assert torch.equal(native, cpu_native.prefill_attention(*args, None))
    assert rel_err(native, ref) < 1e-5
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert torch.equal(kernels.prefill_attention(*args), ref)
    monkeypatch.delenv(kernels.ENV_VAR)
    assert cpu_native.prefill_attention(q.bfloat16(), *args[1:], None) is None
    monkeypatch.setattr(cpu_native, "load", lambda: None)
    assert torch.equal(kernels.prefill_attention(*args), ref)


def test_a_failed_build_falls_back_with_the_reason_logged(monkeypatch, capsys, tmp_path):
    import torch.utils.cpp_extension as ext

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there

    def no_compiler(*a, **k):
        raise RuntimeError("Error building extension\nc++: command not found")

    monkeypatch.setattr(ext, "load", no_compiler)
    monkeypatch.setattr(cpu_native, "load_isa", cpu_native.load_isa.__wrapped__)  # no cache
    assert cpu_native.load.__wrapped__() is None
    err = capsys.readouterr()
    assert "cpu_attention_kernel_unavailable" in err.out + err.err
    assert "c++: command not found" in err.out + err.err


def test_one_builder_a_stale_torch_lock_removed_and_built_libraries_imported(monkeypatch, tmp_path):
    """A builder killed mid-build leaves torch's lock file, on which torch's builder would
    wait forever: the next build removes it under its own flock. Once the ``built`` mark is
    there, processes import the library with no build at all."""
    import torch.utils.cpp_extension as ext

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = cpu_native.build_dir("k")
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")  # left by a killed builder
    builds = []

    def fake_build(name, sources, **kwargs):
        assert not (folder / "lock").exists()
        builds.append(kwargs["build_directory"])
        return "built-module"

    monkeypatch.setattr(ext, "load", fake_build)
    monkeypatch.setattr(cpu_native, "_import", lambda path, name: ("imported", path.name))
    assert cpu_native._load_or_build("k") == "built-module"
    assert builds == [str(folder)] and (folder / "built").exists()
    assert cpu_native._load_or_build("k") == ("imported", "k.so")
    assert len(builds) == 1


def test_pointwise_ops_match_the_reference(gen):
    """RMSNorm (with and without the residual add), rotary in place on views into one packed
    qkv row, and SiLU-and-mul, against the torch reference in float64."""
    x, residual = torch.randn(2, 37, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    out, total = cpu_native.rms_norm(x, weight, 1e-5, residual)
    ref, ref_total = pointwise_ref.rms_norm(x.double(), weight.double(), 1e-5, residual.double())
    assert rel_err(out, ref) < 1e-6 and torch.equal(total, x + residual)
    alone = cpu_native.rms_norm(x, weight, 1e-6)
    assert alone[1] is None
    assert rel_err(alone[0], pointwise_ref.rms_norm(x.double(), weight.double(), 1e-6)[0]) < 1e-6

    qkv = torch.randn(37, 9 + 2 * 3, 64, generator=gen)
    before = qkv.clone()
    cos, sin = torch.randn(2, 37, 64, generator=gen)
    q, k = qkv[:, :9], qkv[:, 9:12]
    ref_q, ref_k = pointwise_ref.rotary(q.double(), k.double(), cos.double(), sin.double())
    assert cpu_native.rotary(q, k, cos, sin) == (q, k)  # in place, as the Triton op
    assert rel_err(qkv[:, :9], ref_q) < 1e-6 and rel_err(qkv[:, 9:12], ref_k) < 1e-6
    assert torch.equal(qkv[:, 12:], before[:, 12:]), "v was touched"

    gate_up = torch.randn(37, 2 * 1536, generator=gen) * 4
    got = cpu_native.silu_and_mul(gate_up)
    assert got is not None and rel_err(got, pointwise_ref.silu_and_mul(gate_up.double())) < 1e-6


def test_pointwise_dispatch(monkeypatch, gen):
    """kernels.* take the compiled ops on CPU float32 rows, the reference under
    PDSERVE_KERNELS=torch, for other dtypes and where the module is not built."""
    x = torch.randn(5, 64, generator=gen)
    weight = torch.randn(64, generator=gen)
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    native = kernels.rms_norm(x, weight, 1e-5)[0]
    assert torch.equal(native, cpu_native.rms_norm(x, weight, 1e-5)[0])
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert torch.equal(
        kernels.rms_norm(x, weight, 1e-5)[0], pointwise_ref.rms_norm(x, weight, 1e-5)[0]
    )
    monkeypatch.delenv(kernels.ENV_VAR)
    assert cpu_native.silu_and_mul(x.bfloat16()) is None
    assert cpu_native.rms_norm(x.t(), weight, 1e-5) is None  # rows not contiguous
    monkeypatch.setattr(cpu_native, "load", lambda: None)
    assert torch.equal(kernels.silu_and_mul(x), pointwise_ref.silu_and_mul(x))


def test_pointwise_ops_take_no_rows():
    """A context-parallel rank with no piece of a step runs its layers on zero tokens."""
    x = torch.empty(0, 64)
    out, total = cpu_native.rms_norm(x, torch.ones(64), 1e-5, torch.empty(0, 64))
    assert out.shape == total.shape == (0, 64)
    q, k = torch.empty(0, 2, 64), torch.empty(0, 1, 64)
    assert cpu_native.rotary(q, k, torch.empty(0, 64), torch.empty(0, 64)) == (q, k)
    assert cpu_native.silu_and_mul(torch.empty(0, 128)).shape == (0, 64)


# --- one build per ISA: each checked to be its ISA's code, and correct ---------------------

# The ISAs a CI machine can test: AVX-512 and AVX2 wherever the CPU runs them (an AVX-512
# machine runs both, so the AVX2 build is tested there too); the portable (SSE2) build in
# the slow lane (a third build, ~30 s on 2 cores). Each builds once per machine (cached in
# TORCH_EXTENSIONS_DIR) and loads once per test session (load_isa is cached).
ISA_PARAMS = [
    "avx512",
    "avx2",
    pytest.param("portable", marks=pytest.mark.slow),
]


def isa_build(isa: str):
    if isa not in cpu_native.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    module = cpu_native.load_isa(isa)
    # the tag is compiled in by the sources' #if on the compiler's ISA macros: a build whose
    # -march did not apply (a scalar or SSE fallback) reports another one
    assert module.isa() == cpu_native.ISA_TAGS[isa]
    return module


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_each_isa_build_matches_the_reference(gen, isa):
    """Decode, prefill (ragged, GQA, windowed, a head_dim of one AVX-512 vector) and the
    pointwise ops of one ISA's build against the reference in float64."""
    module = isa_build(isa)
    for window in (None, 24):
        ctx_lens, num_heads, num_kv_heads, head_dim, block = CASES["ragged-gqa4"]
        paged = Paged(ctx_lens, num_kv_heads, head_dim, block, torch.float32, "cpu", gen)
        q = random_q(len(ctx_lens), num_heads, num_kv_heads, head_dim, torch.float32, "cpu", gen)
        args = (paged.layer, paged.context_lens, paged.block_tables, head_dim**-0.5, window)
        out = cpu_native.decode_attention(q, *args, module=module)
        assert rel_err(out, reference.decode_attention(*map(cpu64, (q, *args)))) < 1e-5
        for case in ("after-a-prefix", "mha-d16-ragged-tiles"):
            seqs, num_heads, num_kv_heads, head_dim, block = PREFILL_CASES[case]
            ctx = [c for c, _ in seqs]
            paged = Paged(ctx, num_kv_heads, head_dim, block, torch.float32, "cpu", gen)
            q_lens = torch.tensor([n for _, n in seqs])
            cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int()
            q = random_q(
                int(q_lens.sum()), num_heads, num_kv_heads, head_dim, torch.float32, "cpu", gen
            )
            pargs = (paged.layer, cu, paged.context_lens, paged.block_tables, 0.1, window)
            out = cpu_native.prefill_attention(q, *pargs, module=module)
            assert out is not None and not out.isnan().any()
            assert rel_err(out, reference.prefill_attention(*map(cpu64, (q, *pargs)))) < 1e-5
    x, residual = torch.randn(2, 13, 200, generator=gen)  # 200: a tail past every vector
    weight = torch.randn(200, generator=gen)
    out, total = cpu_native.rms_norm(x, weight, 1e-5, residual, module=module)
    ref, _ = pointwise_ref.rms_norm(x.double(), weight.double(), 1e-5, residual.double())
    assert rel_err(out, ref) < 1e-6 and torch.equal(total, x + residual)
    qkv = torch.randn(13, 6, 48, generator=gen)
    cos, sin = torch.randn(2, 13, 48, generator=gen)
    ref_q, ref_k = pointwise_ref.rotary(
        qkv[:, :4].double(), qkv[:, 4:5].double(), cos.double(), sin.double()
    )
    cpu_native.rotary(qkv[:, :4], qkv[:, 4:5], cos, sin, module=module)
    assert rel_err(qkv[:, :4], ref_q) < 1e-6 and rel_err(qkv[:, 4:5], ref_k) < 1e-6
    gate_up = torch.randn(13, 2 * 100, generator=gen) * 4
    got = cpu_native.silu_and_mul(gate_up, module=module)
    assert rel_err(got, pointwise_ref.silu_and_mul(gate_up.double())) < 1e-6


def test_the_best_build_the_cpu_runs_is_loaded_and_a_forced_one_obeyed(monkeypatch):
    best = cpu_native.supported_isas()[0]
    monkeypatch.delenv(cpu_native.ISA_ENV, raising=False)
    assert cpu_native.load.__wrapped__().isa() == cpu_native.ISA_TAGS[best]
    if "avx2" in cpu_native.supported_isas():
        monkeypatch.setenv(cpu_native.ISA_ENV, "avx2")  # an AVX2 machine, here
        assert cpu_native.load.__wrapped__().isa() == "avx2"
    monkeypatch.setenv(cpu_native.ISA_ENV, "neon")
    assert cpu_native.load.__wrapped__() is None  # logged: expected one of ...


def test_a_build_that_fails_falls_back_to_the_next_isa(monkeypatch, capsys):
    """The best ISA's build failing (an old compiler without -march=x86-64-v4, say) loads the
    next one the CPU runs, the reason logged; none building leaves the reference."""
    isas = cpu_native.supported_isas()
    real = cpu_native.load_isa
    monkeypatch.delenv(cpu_native.ISA_ENV, raising=False)

    def failing(isa):
        if isa == isas[0]:
            raise RuntimeError(f"Error building extension\nunrecognized -march for {isa}")
        return real(isa)

    monkeypatch.setattr(cpu_native, "load_isa", failing)
    if len(isas) > 1:
        assert cpu_native.load.__wrapped__().isa() == cpu_native.ISA_TAGS[isas[1]]
        assert f"unrecognized -march for {isas[0]}" in "".join(capsys.readouterr())

    def broken(isa):
        raise RuntimeError("Error building extension\nc++: command not found")

    monkeypatch.setattr(cpu_native, "load_isa", broken)
    assert cpu_native.load.__wrapped__() is None


def test_the_chooser_takes_the_reference_where_the_kernel_is_slower(monkeypatch, gen, capsys):
    """A kernel slower than the reference on this CPU (a timing injected) is not used: the
    dispatch returns the reference bit for bit; the choice is logged once with the ISA, the
    kernel and both timings. The faster one is used."""
    timings = {"paged_decode": (3.0, 2.0), "paged_prefill": (1.0, 2.0), "silu_and_mul": (5.0, 1.0)}
    monkeypatch.setattr(cpu_native, "measure", lambda kernel, module: timings[kernel])
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    cpu_native.reset_choices()
    paged = Paged([9, 200], 1, 16, 16, torch.float32, "cpu", gen)
    q = torch.randn(2, 2, 16, generator=gen)
    args = (q, paged.layer, paged.context_lens, paged.block_tables, 0.25)
    assert torch.equal(kernels.decode_attention(*args), reference.decode_attention(*args))
    log = "".join(capsys.readouterr())
    assert "cpu_kernel_choice" in log and "paged_decode" in log and "reference" in log
    assert "3.0" in log and "2.0" in log and cpu_native.loaded_isa() in log
    gate_up = torch.randn(5, 64, generator=gen)
    assert torch.equal(kernels.silu_and_mul(gate_up), pointwise_ref.silu_and_mul(gate_up))
    qp = torch.randn(9 + 50, 2, 16, generator=gen)
    cu = torch.tensor([0, 9, 59], dtype=torch.int32)
    pargs = (qp, paged.layer, cu, paged.context_lens, paged.block_tables, 0.25)
    assert torch.equal(
        kernels.prefill_attention(*pargs), cpu_native.prefill_attention(*pargs, None)
    )
    assert cpu_native.describe()["native_choices"]["paged_decode"]["compiled"] is False
    calls = []
    monkeypatch.setattr(cpu_native, "measure", lambda kernel, module: calls.append(kernel))
    kernels.decode_attention(*args)
    assert calls == [], "the choice is made once per process"


def test_the_chooser_falls_back_where_no_build_loads(monkeypatch, gen):
    monkeypatch.setattr(cpu_native, "load", lambda: None)
    cpu_native.reset_choices()
    assert not any(cpu_native.chosen(k) for k in cpu_native.KERNELS)
    x, weight = torch.randn(5, 64, generator=gen), torch.randn(64, generator=gen)
    assert torch.equal(
        kernels.rms_norm(x, weight, 1e-5)[0], pointwise_ref.rms_norm(x, weight, 1e-5)[0]
    )


def test_the_real_probe_times_every_kernel(monkeypatch):
    """measure() itself (what the tests above replace) runs each kernel's probe on both paths
    and returns two positive timings; which wins is not asserted."""
    monkeypatch.undo()
    module = cpu_native.load()
    for kernel in cpu_native.KERNELS:
        native_ms, ref_ms = cpu_native.measure(kernel, module, repeats=1)
        assert 0 < native_ms < 1e4 and 0 < ref_ms < 1e4

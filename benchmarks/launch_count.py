"""Kernel launches of one decode step, by layer, counted on CPU (no GPU needed): the
torch ops that would each launch a CUDA kernel, plus the Triton kernels (run through
Triton's interpreter, PDSERVE_KERNELS=triton), under the model's layers' attention and
MLP modules. A proxy of a CUDA graph's node count: on an H100 a decode step's graph costs
~1-2 us a node whatever the node does, so a batch-1 step of thousands of small ops is
bound by their count, not by the bytes it reads (DeepSeek-V4-Flash: ~190 nodes a layer).

    python benchmarks/launch_count.py [--model DIR] [--dtype bfloat16] [-v]

Default model: tests' random DeepSeek-V4 (sliding, CSA, HCA, CSA layers), written to a
temporary folder. Views, allocations and no-op casts are not counted; an op inside a
Triton launch (the interpreter's copies) is not either.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PDSERVE_KERNELS", "triton")

import argparse  # noqa: E402
import collections  # noqa: E402
import tempfile  # noqa: E402

from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

# no kernel of their own (views, allocations, reads of a scalar)
FREE = set(
    """view reshape as_strided slice select unsqueeze squeeze transpose t expand permute
    _unsafe_view alias empty empty_strided detach detach_ lift_fresh resolve_conj resolve_neg
    result_type _reshape_alias unbind split narrow chunk view_as empty_like is_nonzero item
    _local_scalar_dense flatten unflatten split_with_sizes contiguous numpy_T new_empty
    set_ promote_types""".split()
)


def count(engine, verbose: bool) -> dict[str, collections.Counter]:  # noqa: ANN001
    import triton.runtime.interpreter as interp

    run = interp.InterpretedFunction.run

    def traced(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        with record_function("triton::" + self.fn.__name__):
            return run(self, *a, **k)

    interp.InterpretedFunction.run = traced
    model = engine.runner.model
    for name, mod in model.named_modules():
        parts = name.split(".")
        if (
            len(parts) >= 2
            and parts[-2] == "layers"
            or (
                len(parts) >= 3
                and parts[-3] == "layers"
                and parts[-1] in ("attn", "self_attn", "ffn", "mlp")
            )
        ):

            def pre(m, *_a, _n=name):  # noqa: ANN001, ANN202
                m._launch_scope = record_function("mod::" + _n)
                m._launch_scope.__enter__()

            def post(m, *_a):  # noqa: ANN001, ANN202
                m._launch_scope.__exit__(None, None, None)

            mod.register_forward_pre_hook(pre)
            mod.register_forward_hook(post)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    interp.InterpretedFunction.run = run
    per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in prof.events():
        parent, scope, inside = e.cpu_parent, "outside the layers", False
        while parent is not None:
            if parent.name.startswith(("aten::", "triton::")):
                inside = True
                break
            if parent.name.startswith("mod::") and scope == "outside the layers":
                scope = parent.name[5:]
            parent = parent.cpu_parent
        if inside:
            continue
        if e.name.startswith("triton::") or (
            e.name.startswith("aten::")
            and e.name[6:] not in FREE
            and not (e.name == "aten::to" and not _copies(e))
        ):
            per[scope][e.name] += 1
    return per


def _copies(event) -> bool:  # noqa: ANN001
    """Whether an aten::to made a copy (its children include one)."""
    return any(c.name in ("aten::_to_copy", "aten::copy_") for c in event.cpu_children)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("-v", "--verbose", action="store_true", help="the ops of each scope")
    args = ap.parse_args()
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams

    model = args.model
    if model is None:
        from pdserve.common.model.fixtures.random import save_random_v4

        model = str(save_random_v4(tempfile.mkdtemp(prefix="launch_count_") + "/v4"))
    engine = LLMEngine(
        EngineConfig(
            model=model, dtype=args.dtype, kv_cache_memory_gb=0.05, enable_prefix_caching=False
        )
    )
    engine.add_request(
        "a", list(range(5, 5 + args.context)), SamplingParams(max_tokens=64, ignore_eos=True)
    )
    for _ in range(6):  # the prefill, then decode steps (their memos warm)
        engine.step()
    per = count(engine, args.verbose)
    total = 0
    for scope, ops in sorted(per.items()):
        n = sum(ops.values())
        total += n
        print(f"{n:6d}  {scope}")
        if args.verbose:
            print("        " + ", ".join(f"{k.split('::')[1]} {v}" for k, v in ops.most_common()))
    print(f"{total:6d}  in all (one decode step, batch 1)")


if __name__ == "__main__":
    main()

"""``pdserve bench engine``: the monolithic engine against Hugging Face transformers.

Same machine, same process, same model directory, same dtype, same prompts. Examples:

    pdserve bench engine --json benchmarks/results/engine_cpu.json
    pdserve bench engine --device cuda --batch-sizes 1,16,64 \
        --json benchmarks/results/engine_cuda.json

For each batch size b, with prompts of random token ids (seeded, distinct per sequence,
so nothing could come from a prefix cache; the engine also runs with prefix caching off):

* prefill tok/s = b * prompt_len / seconds. Engine: from adding b requests with
  max_tokens=1 until the last first token (the whole batch is one step). HF: one forward
  over the [b, prompt_len] batch with use_cache=True and, where the model supports it,
  logits for the last position only (the engine computes no others either).
* decode tok/s = b * (gen_len - 1) / seconds. Engine: b requests decode gen_len tokens
  with ignore_eos; only the steps after every first token are timed. HF: generate() with
  min_new_tokens=max_new_tokens=gen_len, greedy, KV cache on, minus the prefill time
  measured just before on the same prompts.

Every batch size gets one untimed warm-up run per side, then --repeats timed runs whose
median is reported. The engine runs every batch size first and is freed before HF loads:
both side by side do not fit one 80 GB card at the 8B shape (weights twice, the engine's
KV cache beside HF's batch-64 forward). An HF batch that still runs out of device memory
is skipped and the table says so. The table goes to stdout, logs and progress to stderr;
--json also records the machine's load average, since other processes on a shared
machine skew every number.
"""

from __future__ import annotations

import argparse
import gc
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.cli.bench.arg_types import gen_len_arg, positive_int, positive_ints
from pdserve.cli.bench.bench_rows import (
    FLOOR_COLUMNS,
    add_floors,
    bench_config,
    format_table,
    make_row,
    median_timing,
    write_json,
)
from pdserve.cli.bench.bench_runners import (
    EngineBench,
    HFBench,
    Timing,
    make_sync,
    progress,
    random_prompts,
)
from pdserve.cli.engine_flags import add_kv_cache_dtype

if TYPE_CHECKING:
    from pdserve.common.engine.llm_engine import LLMEngine


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "engine",
        help="monolithic engine vs Hugging Face transformers (prefill and decode tok/s)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: embedded)")
    p.add_argument(
        "--shape",
        default=None,
        choices=(
            "1b",
            "8b",
            "dsv3",
            "dsv3-mini",
            "30b-a3b",
            "30b-a3b-full",
            "v2-lite",
            "dsv32",
            "dsv4-flash",
        ),  # fmt: skip
        help="a random bf16 model of this shape (1B: Llama 3.2's, 8B: Llama 3.1's, dsv3: "
        "DeepSeek-V3's MLA attention on 4 dense layers, dsv3-mini: its per-head sizes at 16 heads, "
        "hidden 1024, 2 layers (CPU profiling), 30b-a3b: Qwen3-30B-A3B's MoE layer, "
        "4 layers; 30b-a3b-full: all its 48 layers, v2-lite: DeepSeek-V2-Lite's 27 layers, "
        "dsv32: DeepSeek-V3.2's layers (1 dense, 3 MoE), dsv4-flash: DeepSeek-V4-Flash's "
        "first 4 layers (window, window, CSA, HCA; 3 hash-routed), these four with their "
        "routed experts zeros (common/model/fixtures/random_shapes.py)), written once into the model "
        "cache, instead of --model",
    )
    p.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        help="with --shape: that many layers instead of the shape's own",
    )
    p.add_argument(
        "--routed-experts",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --shape 30b-a3b-full, v2-lite, dsv32 or dsv4-flash: N routed experts a "
        "layer instead of the shape's, drawn at random instead of zeros (the routing decides "
        "the output: what --compare-tokens needs), e.g. dsv4-flash's 4 layers at 32 experts "
        "are 8 GB, which HF holds on one 80 GB GPU",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="with --shape: a model directory whose tokenizer (and vocabulary) the random "
        "checkpoint takes (default: the embedded model's)",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    add_kv_cache_dtype(p, default="auto")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="auto: float32 on CPU, bfloat16 on CUDA",
    )
    p.add_argument("--prompt-len", type=positive_int, default=256)
    p.add_argument(
        "--gen-len", type=gen_len_arg, default=32, help="tokens per sequence, at least 2"
    )
    p.add_argument(
        "--batch-sizes", type=positive_ints, default=[1, 16], help="comma-separated, e.g. 1,16"
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="timed runs per number (the median is reported)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face reference")
    p.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="decode steps launch kernel by kernel (the before of common/engine/cuda_graphs.py)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="tokens a prefill step may take (default: the largest batch's prompts, one "
        "forward); smaller where a shape's prefill activations would not fit beside its weights",
    )
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="each step waits for the last one's tokens (the before of "
        "common/engine/async_steps.py)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="decode tok/s with and without speculative decoding in the same run "
        '(cli/bench/bench_spec.py); \'"model": "self"\' drafts with the target itself',
    )
    p.add_argument(
        "--dspark",
        type=positive_int,
        default=None,
        metavar="K",
        help="decode with and without DSpark of k = K (method dspark) in the same run, as "
        "--speculative-config does, each row with the verify step's forward beside a plain "
        "decode step's and greedy tokens checked equal; a DeepSeek-V4 checkpoint without a "
        "DSpark module (a --shape's) gets a random one, written once into the model cache "
        "(acceptance near zero: the rows are the cost; cli/bench/bench_spec.py)",
    )
    p.add_argument(
        "--dspark-stages",
        type=positive_int,
        default=1,
        help="with --dspark: the random module's stages (V4 blocks, each with its own "
        "routed experts: 12 GiB a stage at dsv4-flash in bf16)",
    )
    p.add_argument(
        "--dspark-bigram",
        action="store_true",
        help="with --dspark and a random module: its Markov head set, before the timed "
        "runs, to a bigram table of the target's own greedy output on the run's prompts "
        "(each token to the one that most often follows it there), so that some drafts "
        "are accepted: acceptance from the target's habits, not a trained module's",
    )
    p.add_argument(
        "--compare-tokens",
        action="store_true",
        help="also check the engine's greedy tokens against HF generate's on each batch "
        "size's first timed prompts (gen_len tokens each; the sequences equal, and where "
        "one is not, the first position that differs; exit status 1 where any differs)",
    )
    p.add_argument(
        "--workload",
        default="random",
        choices=("random", "repeat"),
        help="with --speculative-config: random-token prompts, or prompts asking to repeat a text",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the config and rows here",
    )
    p.set_defaults(run=run)


def group_blocks(model: str | None, tokens: int, chunk: int, block_size: int) -> int:
    """The blocks a sequence of ``tokens`` holds at most over the model's KV cache groups
    (common/engine/kv_groups.py: DeepSeek-V4's window of every layer plus its compressed
    entries, sliding layers' windows), prefilled ``chunk`` tokens a step; 0 where the
    checkpoint's config cannot be read here (a GGUF file, the embedded default)."""
    from pdserve.common.engine.kv_groups import cache_groups
    from pdserve.common.errors import ModelLoadError
    from pdserve.common.model.checkpoint.config import ModelConfig

    if model is None or not (Path(model) / "config.json").is_file():
        return 0
    try:
        cfg = ModelConfig.from_dir(Path(model))
    except ModelLoadError:
        return 0
    return sum(g.max_blocks(tokens, block_size, chunk) for g in cache_groups(cfg))


def build_engine(args: argparse.Namespace) -> LLMEngine:
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine

    max_batch = max(args.batch_sizes)
    block_size = EngineConfig().block_size
    spec = None
    extra = 0
    if args.speculative_config is not None or args.dspark is not None:
        from pdserve.cli.bench.bench_spec import spec_config_of

        spec = spec_config_of(args)
        # the drafts' slots, and the repeat workload's prompts run a little past prompt_len
        extra = spec.num_speculative_tokens + (args.prompt_len if args.workload == "repeat" else 0)
    tokens = args.prompt_len + args.gen_len + extra
    blocks_per_seq = max(
        -(-tokens // block_size), group_blocks(args.model, tokens, args.prompt_len, block_size)
    )
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=block_size,
        # Exactly the blocks the largest batch needs: no preemption, no oversized cache.
        num_kv_blocks=max_batch * blocks_per_seq,
        max_num_seqs=max_batch,
        # The whole batch's prompts fit in one step, so prefill is a single forward (unless
        # --max-num-batched-tokens chunks it).
        max_num_batched_tokens=args.max_num_batched_tokens or max_batch * (args.prompt_len + extra),
        enable_prefix_caching=False,
        cuda_graphs=not args.no_cuda_graphs,
        async_scheduling=False if args.no_async_scheduling else None,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=spec,
    )
    return LLMEngine(config)


def timed_runs(
    batch: int, args: argparse.Namespace, vocab: int, side: EngineBench | HFBench
) -> list[Any]:
    """One untimed warm-up, then --repeats timed runs of ``side`` on seeded prompts (the
    same prompts for the engine and HF)."""
    warm_up, *timed = (
        random_prompts(vocab, batch, args.prompt_len, args.seed, i) for i in range(args.repeats + 1)
    )
    name = "engine" if isinstance(side, EngineBench) else "HF"
    progress(f"{name} batch {batch}: warm-up")
    side.run(warm_up, args.gen_len)
    runs = []
    for i, prompts in enumerate(timed, 1):
        progress(f"{name} batch {batch}: run {i}/{args.repeats}")
        runs.append(side.run(prompts, args.gen_len))
    return runs


def hf_timings(
    args: argparse.Namespace, model_dir: Path, dtype: Any, vocab: int
) -> tuple[dict[int, Timing], dict[int, str], dict[Any, Any]]:
    """HF's median timing per batch size, why a batch size has none (out of memory), and
    with --compare-tokens its greedy tokens per batch size (``"class"``: the model class)."""
    import torch

    hf = HFBench(model_dir, dtype, args.device, make_sync(args.device))
    timings: dict[int, Timing] = {}
    skipped: dict[int, str] = {}
    tokens: dict[Any, Any] = {}
    if args.compare_tokens:
        tokens["class"] = f"{type(hf.model).__module__}.{type(hf.model).__name__}"
    for batch in args.batch_sizes:
        try:
            if args.compare_tokens:
                tokens[batch] = hf.greedy(first_prompts(args, vocab, batch), args.gen_len)
            timings[batch] = median_timing(timed_runs(batch, args, vocab, hf))
        except torch.OutOfMemoryError:
            gc.collect()
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info()[0] / 2**30
            skipped[batch] = f"out of device memory ({free:.0f} GiB free after the model)"
            progress(f"HF batch {batch}: skipped, {skipped[batch]}")
    return timings, skipped, tokens


def first_prompts(args: argparse.Namespace, vocab: int, batch: int) -> list[list[int]]:
    """The first timed run's prompts at ``batch`` (those --compare-tokens generates)."""
    return random_prompts(vocab, batch, args.prompt_len, args.seed, 1)


def engine_greedy(
    args: argparse.Namespace, engine: LLMEngine, vocab: int
) -> dict[int, list[list[int]]]:
    """The engine's greedy tokens (gen_len each) on each batch size's first timed prompts."""
    from pdserve.common.engine.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=args.gen_len, ignore_eos=True)
    out = {}
    for batch in args.batch_sizes:
        progress(f"engine batch {batch}: greedy tokens for --compare-tokens")
        done = engine.generate(first_prompts(args, vocab, batch), greedy)
        out[batch] = [c.token_ids for c in done]
    return out


def compare_greedy(
    engine: dict[int, list[list[int]]], hf: dict[Any, Any]
) -> dict[str, dict[str, Any]]:
    """Per batch size HF ran: sequences, how many are equal, and each one's first position
    where the engine and HF differ (None where equal)."""
    out = {}
    for batch, mine in engine.items():
        if batch not in hf:
            continue
        first = [
            next((i for i, (a, b) in enumerate(zip(m, h, strict=False)) if a != b),
                 None if len(m) == len(h) else min(len(m), len(h)))
            for m, h in zip(mine, hf[batch], strict=True)
        ]  # fmt: skip
        out[str(batch)] = {
            "sequences": len(mine),
            "equal": sum(d is None for d in first),
            "first_difference": first,
        }
    return out


def dspark_checkpoint(args: argparse.Namespace) -> Path:
    """--dspark's checkpoint: ``args.model`` where its config.json names a DSpark module
    (``dspark_block_size``); else, for a DeepSeek-V4 checkpoint, a copy with a random module
    of --dspark-stages stages and a block of K (its routed experts zeros where the target's
    are, a --shape's), written once into the model cache."""
    import json

    model = Path(args.model) if args.model is not None else None
    raw = (
        json.loads((model / "config.json").read_text())
        if model is not None and (model / "config.json").is_file()
        else {}
    )
    if "dspark_block_size" in raw:
        if args.dspark_bigram:
            raise SystemExit("pdserve bench engine: --dspark-bigram rewrites a random module's "
                             f"Markov head; {model} has a DSpark module of its own")  # fmt: skip
        return model  # type: ignore[return-value]
    if raw.get("model_type") != "deepseek_v4":
        raise SystemExit(
            "pdserve bench engine: --dspark needs a DeepSeek-V4 checkpoint (--shape dsv4-flash "
            f"or --model DIR); {args.model or 'the embedded default'} is not one"
        )
    from pdserve.cli.bench.bench_spec import BIGRAM_RANK
    from pdserve.common.model.fixtures.random_dspark import v4_dspark_model

    progress(f"random DSpark module ({args.dspark_stages} stages, block {args.dspark})")
    args.dspark_random = True
    return v4_dspark_model(
        model,  # type: ignore[arg-type]
        num_stages=args.dspark_stages,
        block_size=args.dspark,
        markov_rank=BIGRAM_RANK if args.dspark_bigram else 16,
        dtype=str(raw.get("torch_dtype", "float32")),
        zero_experts=args.shape is not None,
    )


def refuse_unsupported_shape(args: argparse.Namespace) -> None:
    """A ModelLoadError (``pdserve: error: ...``, exit 2) when the device cannot run the
    shape's model (DeepSeek-V3.2 and V4 on CUDA need kernels), before its checkpoint is
    written."""
    from pdserve.common.model.fixtures.random_shapes import CONFIG_SHAPES, shape_config

    if args.shape not in CONFIG_SHAPES:
        return
    import torch

    from pdserve.common.engine.model_loader import check_device_supports
    from pdserve.common.model.checkpoint.config import ModelConfig

    raw = {**shape_config(args.shape, args.layers), "vocab_size": 1}
    check_device_supports(ModelConfig.from_dict(raw), torch.device(args.device))


def run(args: argparse.Namespace) -> int:
    from pdserve.common.runtime.log import configure_logging

    configure_logging("WARNING")
    if args.compare_tokens and args.no_hf:
        raise SystemExit("pdserve bench engine: --compare-tokens needs HF (drop --no-hf)")
    if args.dspark is not None and args.speculative_config is not None:
        raise SystemExit("pdserve bench engine: give --dspark or --speculative-config, not both")
    if args.dspark_bigram and args.dspark is None:
        raise SystemExit("pdserve bench engine: --dspark-bigram needs --dspark")
    if args.shape is not None:
        if args.model is not None:
            raise SystemExit("pdserve bench engine: give --model or --shape, not both")
        from pdserve.common.model.fixtures.random_shapes import random_shape_model

        refuse_unsupported_shape(args)  # before writing tens of GB
        progress(f"random {args.shape} checkpoint")
        try:
            args.model = str(
                random_shape_model(
                    args.shape,
                    num_layers=args.layers,
                    device=args.device,
                    tokenizer_from=args.tokenizer,
                    routed_experts=args.routed_experts,
                )
            )
        except ValueError as e:  # --routed-experts the shape cannot take
            raise SystemExit(f"pdserve bench engine: {e}") from None
        if args.shape == "dsv3" and '"mtp"' in (args.speculative_config or ""):
            from pdserve.common.model.fixtures.random_mtp import add_random_mtp_layer

            add_random_mtp_layer(Path(args.model), args.device)  # random drafts: the cost
    elif args.layers is not None or args.routed_experts is not None:
        raise SystemExit("pdserve bench engine: --layers and --routed-experts need --shape")
    if args.compare_tokens and args.no_hf:
        raise SystemExit("pdserve bench engine: --compare-tokens needs HF (drop --no-hf)")
    if args.dspark is not None:
        if args.speculative_config is not None:
            raise SystemExit(
                "pdserve bench engine: give --dspark or --speculative-config, not both"
            )
        args.model = str(dspark_checkpoint(args))
    load_at_start = os.getloadavg()[0]
    engine = build_engine(args)
    if args.speculative_config is not None or args.dspark is not None:
        from pdserve.cli.bench.bench_spec import run_spec

        bench = EngineBench(engine, make_sync(args.device))
        return run_spec(args, engine, bench, random_prompts, format_table)
    engine_bench = EngineBench(engine, make_sync(args.device))
    from pdserve.cli.bench import bench_floors

    ceilings = bench_floors.measure(engine)
    vocab = engine.model_config.vocab_size
    engine_rows: dict[int, tuple[Timing, int]] = {}
    for batch in args.batch_sizes:
        runs = timed_runs(batch, args, vocab, engine_bench)
        engine_rows[batch] = (median_timing([t for t, _ in runs]), max(s for _, s in runs))
    engine_tokens = engine_greedy(args, engine, vocab) if args.compare_tokens else {}
    config = bench_config(args, engine, load_at_start)
    config["ceilings"] = asdict(ceilings)
    config["cuda_graphs"] = getattr(engine.runner, "graphs", None) is not None
    config["async_scheduling"] = engine.is_async_scheduling
    model_dir, dtype = engine.model_dir, engine.runner.dtype
    del engine_bench, engine  # the device memory goes back before HF loads
    gc.collect()
    if args.device == "cuda":
        import torch

        torch.cuda.empty_cache()
    hf, skipped, hf_tokens = (
        ({}, {}, {}) if args.no_hf else hf_timings(args, model_dir, dtype, vocab)
    )
    config["hf_skipped"] = {str(b): why for b, why in skipped.items()}
    if args.compare_tokens:
        config["hf_class"] = hf_tokens.pop("class", None)
        config["greedy_vs_hf"] = compare_greedy(engine_tokens, hf_tokens)
    rows = []
    for batch, (timing, steps) in engine_rows.items():
        row = make_row(batch, args.prompt_len, timing, steps, hf.get(batch))
        row.hf_skipped = skipped.get(batch)
        add_floors(row, timing, ceilings, args.prompt_len, args.gen_len)
        rows.append(row)
    config["loadavg_1m_end"] = os.getloadavg()[0]
    print(
        f"model {config['model_dir']}  device {config['device']} ({config['device_name']})  "
        f"dtype {config['dtype']}  prompt_len {args.prompt_len}  gen_len {args.gen_len}  "
        f"repeats {args.repeats}  torch {config['torch_version']}  "
        f"threads {config['torch_num_threads']}  "
        f"load {load_at_start:.1f}->{config['loadavg_1m_end']:.1f}"
    )
    print(format_table(rows))
    for batch, why in skipped.items():
        print(f"HF batch {batch}: skipped, {why}")
    for batch, match in config.get("greedy_vs_hf", {}).items():
        diff = match["first_difference"]
        print(
            f"greedy tokens, engine vs HF {config['hf_class']} at batch {batch}: "
            f"{match['equal']}/{match['sequences']} sequences equal"
            + ("" if not any(d is not None for d in diff) else f" (first difference at {diff})")
        )
    print(
        f"\nceilings: copy {ceilings.copy_gbps:.0f} GB/s (read + write), matmul "
        f"{ceilings.matmul_tflops:.1f} TFLOP/s; weights {ceilings.weight_bytes / 2**20:.0f} MiB, "
        f"KV {ceilings.kv_bytes_per_token / 1024:.0f} KiB a token"
    )
    print(format_table(rows, FLOOR_COLUMNS))
    if args.json is not None:
        write_json(args.json, config, rows)
        progress(f"wrote {args.json}")
    matches = config.get("greedy_vs_hf", {}).values()
    return 1 if any(m["equal"] != m["sequences"] for m in matches) else 0

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

Every batch size gets one untimed warm-up run per side, then --repeats timed runs (engine
and HF taking turns) whose median is reported. The table goes to stdout, logs and
progress to stderr; --json also records the machine's load average, since other
processes on a shared machine skew every number.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.cli.engine_flags import add_kv_cache_dtype

if TYPE_CHECKING:
    import torch

    from pdserve.common.engine.llm_engine import LLMEngine

Sync = Callable[[], None]


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
        choices=("1b", "8b", "dsv3", "30b-a3b"),
        help="a random bf16 model of this shape (1B: Llama 3.2's, 8B: Llama 3.1's, dsv3: "
        "DeepSeek-V3's MLA attention on 4 dense layers, 30b-a3b: Qwen3-30B-A3B's MoE layer, "
        "4 layers), written once into the model cache, instead of --model",
    )
    p.add_argument(
        "--layers",
        type=_positive_int,
        default=None,
        help="with --shape: that many layers instead of the shape's own",
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
    p.add_argument("--prompt-len", type=_positive_int, default=256)
    p.add_argument("--gen-len", type=_gen_len, default=32, help="tokens per sequence, at least 2")
    p.add_argument(
        "--batch-sizes", type=_positive_ints, default=[1, 16], help="comma-separated, e.g. 1,16"
    )
    p.add_argument(
        "--repeats",
        type=_positive_int,
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
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="decode tok/s with and without speculative decoding in the same run "
        '(cli/bench_spec.py); \'"model": "self"\' drafts with the target itself',
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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _gen_len(text: str) -> int:
    value = int(text)
    if value < 2:  # decode is every token after the first; one token has none to time
        raise argparse.ArgumentTypeError(f"must be at least 2, got {value}")
    return value


def _positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive integers, e.g. 1,16 (every bench's list flags)."""
    try:
        values = [_positive_int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        ) from exc
    if not values:
        raise argparse.ArgumentTypeError("no value given")
    return values


# -- shared helpers ---------------------------------------------------------------------


def random_prompts(
    vocab_size: int, batch: int, prompt_len: int, seed: int, run_index: int
) -> list[list[int]]:
    """Seeded per (batch, run) so that the engine and HF see exactly the same prompts.

    A string seed is hashed with SHA-512 by ``random``, so it is stable across processes.
    """
    rng = random.Random(f"{seed}/{batch}/{run_index}")
    prompts = [[rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(batch)]
    if len({tuple(p) for p in prompts}) != batch:  # only possible with a toy vocabulary
        raise RuntimeError("random prompts collided; use a longer --prompt-len")
    return prompts


def make_sync(device: str) -> Sync:
    """A barrier before reading the clock: CUDA work is asynchronous."""
    import torch

    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def progress(message: str) -> None:
    print(f"bench engine: {message}", file=sys.stderr, flush=True)


@dataclass
class Timing:
    prefill_s: float
    decode_s: float
    decode_tokens: int  # tokens produced during the timed decode steps
    decode_steps: int = 0  # engine steps of the timed decode (engine side only)
    model_s: float = 0.0  # of decode_s, inside ModelRunner.execute (synced): the forward
    # MoE: distinct (layer, routed expert) pairs a timed decode step read, on average
    experts_touched: float | None = None


# -- the engine side --------------------------------------------------------------------


class EngineBench:
    def __init__(self, engine: LLMEngine, sync: Sync) -> None:
        self.engine = engine
        self.sync = sync
        self._ids = itertools.count()
        from pdserve.common.model.moe import record_expert_usage

        runner = engine.runner
        self.moe_blocks = record_expert_usage(runner.model)
        if self.moe_blocks:  # the graphs were captured without the marking
            runner.recapture_graphs()

    def _add(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[str]:
        from pdserve.common.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        ids = [f"bench-{next(self._ids)}" for _ in prompts]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.engine.add_request(rid, prompt, params)
        return ids

    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[float, int]:
        """Seconds from adding the requests to the last first token, and the steps taken."""
        self.sync()
        start = time.perf_counter()
        self._add(prompts, max_tokens=1)
        steps = 0
        while self.engine.has_unfinished:
            self.engine.step()
            steps += 1
        self.sync()
        return time.perf_counter() - start, steps

    def decode(
        self, prompts: Sequence[Sequence[int]], gen_len: int
    ) -> tuple[float, int, int, float, float | None]:
        """Seconds of the steps after every sequence has its first token, their tokens,
        the steps, the seconds spent in the model's forward (synced after each), and for a
        MoE model the mean count of (layer, expert) pairs a step routed to."""
        waiting_first = set(self._add(prompts, max_tokens=gen_len))
        while waiting_first:
            for out in self.engine.step():
                waiting_first.discard(out.request_id)
        runner = self.engine.runner
        execute = runner.execute
        model_s = 0.0
        import torch

        blocks = self.moe_blocks
        touched = torch.zeros((), dtype=torch.int64, device=runner.device) if blocks else None

        def timed_execute(plan):  # noqa: ANN001, ANN202
            nonlocal model_s
            for block in blocks:  # device ops, no sync: which experts this step reads
                assert block.touched is not None
                block.touched.zero_()
            start = time.perf_counter()
            logits = execute(plan)
            self.sync()  # sampling syncs right after anyway: this moves the wait, adds none
            model_s += time.perf_counter() - start
            if touched is not None:
                touched.add_(torch.stack([b.touched for b in blocks]).sum())  # type: ignore[misc]
            return logits

        runner.execute = timed_execute  # type: ignore[method-assign]
        try:
            self.sync()
            start = time.perf_counter()
            tokens = steps = 0
            while self.engine.has_unfinished:
                tokens += sum(len(out.new_token_ids) for out in self.engine.step())
                steps += 1
            self.sync()
        finally:
            del runner.execute  # the bound method again
        elapsed = time.perf_counter() - start
        mean_touched = None if touched is None else touched.item() / max(1, steps)
        return elapsed, tokens, steps, model_s, mean_touched

    def run(self, prompts: Sequence[Sequence[int]], gen_len: int) -> tuple[Timing, int]:
        prefill_s, steps = self.prefill(prompts)
        decode_s, tokens, decode_steps, model_s, touched = self.decode(prompts, gen_len)
        return Timing(prefill_s, decode_s, tokens, decode_steps, model_s, touched), steps


# -- the Hugging Face side --------------------------------------------------------------


class HFBench:
    def __init__(self, model_dir: Path, dtype: torch.dtype, device: str, sync: Sync) -> None:
        import transformers

        # Generation-config chatter (sampling flags ignored by greedy decoding, ...) would
        # bury the table; errors still show.
        transformers.logging.set_verbosity_error()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model = self.model.to(device).eval()
        self.device = device
        self.sync = sync
        # Logits for the last position only: a [b, prompt_len, vocab] float tensor is
        # pure overhead the engine does not pay, and generate() skips it as well.
        self.prefill_kwargs: dict[str, Any] = {}
        if "logits_to_keep" in inspect.signature(self.model.forward).parameters:
            self.prefill_kwargs["logits_to_keep"] = 1
        gen_cfg = self.model.generation_config
        eos = gen_cfg.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        self.pad_token_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else eos

    def _inputs(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        input_ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        return input_ids, torch.ones_like(input_ids)

    def prefill(self, prompts: Sequence[Sequence[int]]) -> float:
        import torch

        input_ids, mask = self._inputs(prompts)
        with torch.inference_mode():
            self.sync()
            start = time.perf_counter()
            self.model(
                input_ids=input_ids, attention_mask=mask, use_cache=True, **self.prefill_kwargs
            )
            self.sync()
        return time.perf_counter() - start

    def generate(self, prompts: Sequence[Sequence[int]], gen_len: int) -> float:
        import torch

        input_ids, mask = self._inputs(prompts)
        with torch.inference_mode():
            self.sync()
            start = time.perf_counter()
            out = self.model.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=gen_len,
                min_new_tokens=gen_len,
                do_sample=False,
                use_cache=True,
                pad_token_id=self.pad_token_id,
            )
            self.sync()
        seconds = time.perf_counter() - start
        if out.shape[1] != input_ids.shape[1] + gen_len:
            made = out.shape[1] - input_ids.shape[1]
            raise RuntimeError(f"HF generated {made} tokens, not {gen_len}")
        return seconds

    def run(self, prompts: Sequence[Sequence[int]], gen_len: int) -> Timing:
        prefill_s = self.prefill(prompts)
        generate_s = self.generate(prompts, gen_len)
        # generate() = one prefill + (gen_len - 1) decode forwards (+ its own overhead,
        # which counts against decode: a server pays it too).
        return Timing(prefill_s, generate_s - prefill_s, len(prompts) * (gen_len - 1))


# -- results ----------------------------------------------------------------------------


@dataclass
class Row:
    batch: int
    engine_prefill_tok_s: float
    engine_decode_tok_s: float
    engine_prefill_s: float
    engine_decode_s: float
    engine_prefill_steps: int
    hf_prefill_tok_s: float | None = None
    hf_decode_tok_s: float | None = None
    hf_prefill_s: float | None = None
    hf_decode_s: float | None = None
    prefill_ratio: float | None = None  # engine / HF: above 1, the engine is faster
    decode_ratio: float | None = None
    # Against the machine's ceilings (cli/bench_floors.py): ms per decode step, of it
    # the model's forward, the memory floor of that step, and step / floor.
    engine_step_ms: float | None = None
    model_step_ms: float | None = None
    decode_floor_ms: float | None = None
    experts_touched: float | None = None  # MoE: (layer, expert) pairs a decode step reads
    engine_step_over_floor: float | None = None
    model_step_over_floor: float | None = None
    prefill_floor_s: float | None = None  # matmul FLOPs / measured matmul rate
    prefill_over_floor: float | None = None  # engine prefill seconds / that


def median_timing(runs: list[Timing]) -> Timing:
    return Timing(
        statistics.median(t.prefill_s for t in runs),
        statistics.median(t.decode_s for t in runs),
        runs[0].decode_tokens,
        runs[0].decode_steps,
        statistics.median(t.model_s for t in runs),
        None
        if runs[0].experts_touched is None
        else statistics.mean(t.experts_touched or 0.0 for t in runs),
    )


def add_floors(row: Row, engine: Timing, ceilings: Any, prompt_len: int, gen_len: int) -> None:
    from pdserve.cli.bench_floors import decode_floor_s, prefill_floor_s

    if engine.decode_steps:
        # timed steps decode tokens 2..gen_len: contexts prompt_len + 1 .. prompt_len + gen_len - 1
        floor = decode_floor_s(
            ceilings, row.batch, prompt_len + gen_len / 2, engine.experts_touched
        )
        row.experts_touched = engine.experts_touched
        row.engine_step_ms = engine.decode_s / engine.decode_steps * 1e3
        row.model_step_ms = engine.model_s / engine.decode_steps * 1e3
        row.decode_floor_ms = floor * 1e3
        row.engine_step_over_floor = row.engine_step_ms / row.decode_floor_ms
        row.model_step_over_floor = row.model_step_ms / row.decode_floor_ms
    row.prefill_floor_s = prefill_floor_s(ceilings, row.batch, prompt_len)
    row.prefill_over_floor = engine.prefill_s / row.prefill_floor_s


def make_row(batch: int, prompt_len: int, engine: Timing, steps: int, hf: Timing | None) -> Row:
    row = Row(
        batch=batch,
        engine_prefill_tok_s=batch * prompt_len / engine.prefill_s,
        engine_decode_tok_s=engine.decode_tokens / engine.decode_s,
        engine_prefill_s=engine.prefill_s,
        engine_decode_s=engine.decode_s,
        engine_prefill_steps=steps,
    )
    if hf is not None:
        row.hf_prefill_s, row.hf_decode_s = hf.prefill_s, hf.decode_s
        row.hf_prefill_tok_s = batch * prompt_len / hf.prefill_s
        # Noise can beat a decode this short; a non-positive time has no rate.
        row.hf_decode_tok_s = hf.decode_tokens / hf.decode_s if hf.decode_s > 0 else None
        row.prefill_ratio = row.engine_prefill_tok_s / row.hf_prefill_tok_s
        if row.hf_decode_tok_s:
            row.decode_ratio = row.engine_decode_tok_s / row.hf_decode_tok_s
    return row


COLUMNS = (
    ("batch", "batch", "{:d}"),
    ("engine_prefill_tok_s", "engine prefill tok/s", "{:.1f}"),
    ("hf_prefill_tok_s", "HF prefill tok/s", "{:.1f}"),
    ("prefill_ratio", "prefill engine/HF", "{:.2f}x"),
    ("engine_decode_tok_s", "engine decode tok/s", "{:.1f}"),
    ("hf_decode_tok_s", "HF decode tok/s", "{:.1f}"),
    ("decode_ratio", "decode engine/HF", "{:.2f}x"),
)


FLOOR_COLUMNS = (
    ("batch", "batch", "{:d}"),
    ("engine_step_ms", "decode step ms", "{:.2f}"),
    ("model_step_ms", "of it forward ms", "{:.2f}"),
    ("decode_floor_ms", "memory floor ms", "{:.2f}"),
    ("experts_touched", "experts read", "{:.0f}"),
    ("engine_step_over_floor", "step/floor", "{:.2f}x"),
    ("model_step_over_floor", "forward/floor", "{:.2f}x"),
    ("engine_prefill_s", "prefill s", "{:.4f}"),
    ("prefill_floor_s", "matmul floor s", "{:.4f}"),
    ("prefill_over_floor", "prefill/floor", "{:.2f}x"),
)


def format_table(rows: list[Row], columns: tuple[tuple[str, str, str], ...] = COLUMNS) -> str:
    header = [title for _, title, _ in columns]
    body = [
        [fmt.format(v) if (v := getattr(row, key)) is not None else "-" for key, _, fmt in columns]
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.rjust(w) for cell, w in zip(cells, widths, strict=True))

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


def bench_config(
    args: argparse.Namespace, engine: LLMEngine, load_at_start: float
) -> dict[str, Any]:
    import torch

    from pdserve.cli.provenance import provenance

    config: dict[str, Any] = {
        **provenance(),
        "model": args.model or "embedded default",
        "shape": args.shape,
        "model_dir": str(engine.model_dir),
        "device": args.device,
        "device_name": device_name(args.device),
        "dtype": engine.config.torch_dtype_name,
        "kv_cache_dtype": engine.config.kv_cache_dtype,
        "torch_version": torch.__version__,
        "transformers_version": None,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "batch_sizes": args.batch_sizes,
        "repeats": args.repeats,
        "seed": args.seed,
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "hf": not args.no_hf,
        # Other processes on the machine skew every number here: keep the evidence.
        "loadavg_1m_start": load_at_start,
        "loadavg_1m_end": os.getloadavg()[0],
    }
    if not args.no_hf:
        import transformers

        config["transformers_version"] = transformers.__version__
    return config


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return _cpu_model() or platform.processor() or platform.machine()


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return None


def write_json(path: Path, config: dict[str, Any], rows: list[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "engine", "config": config, "rows": [asdict(r) for r in rows]}
    path.write_text(json.dumps(payload, indent=2) + "\n")


# -- the command ------------------------------------------------------------------------


def build_engine(args: argparse.Namespace) -> LLMEngine:
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine

    max_batch = max(args.batch_sizes)
    block_size = EngineConfig().block_size
    spec = None
    extra = 0
    if args.speculative_config is not None:
        from pdserve.cli.bench_spec import spec_config_of

        spec = spec_config_of(args)
        # the drafts' slots, and the repeat workload's prompts run a little past prompt_len
        extra = spec.num_speculative_tokens + (args.prompt_len if args.workload == "repeat" else 0)
    blocks_per_seq = -(-(args.prompt_len + args.gen_len + extra) // block_size)
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=block_size,
        # Exactly the blocks the largest batch needs: no preemption, no oversized cache.
        num_kv_blocks=max_batch * blocks_per_seq,
        max_num_seqs=max_batch,
        # The whole batch's prompts fit in one step, so prefill is a single forward.
        max_num_batched_tokens=max_batch * (args.prompt_len + extra),
        enable_prefix_caching=False,
        cuda_graphs=not args.no_cuda_graphs,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=spec,
    )
    return LLMEngine(config)


def bench_batch(
    batch: int,
    args: argparse.Namespace,
    vocab: int,
    engine: EngineBench,
    hf: HFBench | None,
    ceilings: Any,
) -> Row:
    warm_up, *timed = (
        random_prompts(vocab, batch, args.prompt_len, args.seed, i) for i in range(args.repeats + 1)
    )
    progress(f"batch {batch}: warm-up")
    engine.run(warm_up, args.gen_len)
    if hf is not None:
        hf.run(warm_up, args.gen_len)
    engine_runs: list[Timing] = []
    hf_runs: list[Timing] = []
    steps = 0
    # Engine and HF take turns, so that a burst of load from other processes on the
    # machine hits both sides rather than one.
    for i, prompts in enumerate(timed, 1):
        progress(f"batch {batch}: run {i}/{args.repeats}")
        timing, run_steps = engine.run(prompts, args.gen_len)
        engine_runs.append(timing)
        steps = max(steps, run_steps)
        if hf is not None:
            hf_runs.append(hf.run(prompts, args.gen_len))
    hf_timing = median_timing(hf_runs) if hf_runs else None
    engine_timing = median_timing(engine_runs)
    row = make_row(batch, args.prompt_len, engine_timing, steps, hf_timing)
    add_floors(row, engine_timing, ceilings, args.prompt_len, args.gen_len)
    return row


def run(args: argparse.Namespace) -> int:
    from pdserve.common.runtime.log import configure_logging

    configure_logging("WARNING")
    if args.shape is not None:
        if args.model is not None:
            raise SystemExit("pdserve bench engine: give --model or --shape, not both")
        from pdserve.common.model.random import random_shape_model

        progress(f"random {args.shape} checkpoint")
        args.model = str(
            random_shape_model(
                args.shape,
                num_layers=args.layers,
                device=args.device,
                tokenizer_from=args.tokenizer,
            )
        )
    elif args.layers is not None:
        raise SystemExit("pdserve bench engine: --layers needs --shape")
    load_at_start = os.getloadavg()[0]
    engine = build_engine(args)
    if args.speculative_config is not None:
        from pdserve.cli.bench_spec import run_spec

        bench = EngineBench(engine, make_sync(args.device))
        return run_spec(args, engine, bench, random_prompts, format_table)
    sync = make_sync(args.device)
    engine_bench = EngineBench(engine, sync)
    hf_bench = None
    if not args.no_hf:
        hf_bench = HFBench(engine.model_dir, engine.runner.dtype, args.device, sync)
    from pdserve.cli import bench_floors

    ceilings = bench_floors.measure(engine)
    vocab = engine.model_config.vocab_size
    rows = [bench_batch(b, args, vocab, engine_bench, hf_bench, ceilings) for b in args.batch_sizes]

    config = bench_config(args, engine, load_at_start)
    config["ceilings"] = asdict(ceilings)
    config["cuda_graphs"] = getattr(engine.runner, "graphs", None) is not None
    print(
        f"model {config['model_dir']}  device {config['device']} ({config['device_name']})  "
        f"dtype {config['dtype']}  prompt_len {args.prompt_len}  gen_len {args.gen_len}  "
        f"repeats {args.repeats}  torch {config['torch_version']}  "
        f"threads {config['torch_num_threads']}  "
        f"load {load_at_start:.1f}->{config['loadavg_1m_end']:.1f}"
    )
    print(format_table(rows))
    print(
        f"\nceilings: copy {ceilings.copy_gbps:.0f} GB/s (read + write), matmul "
        f"{ceilings.matmul_tflops:.1f} TFLOP/s; weights {ceilings.weight_bytes / 2**20:.0f} MiB, "
        f"KV {ceilings.kv_bytes_per_token / 1024:.0f} KiB a token"
    )
    print(format_table(rows, FLOOR_COLUMNS))
    if args.json is not None:
        write_json(args.json, config, rows)
        progress(f"wrote {args.json}")
    return 0

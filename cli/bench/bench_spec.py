"""``pdserve bench engine --speculative-config JSON``: decode tokens/s with and without
speculative decoding, in the same run, on the same engine (speculation switched off for
the baseline turns), batch by batch, the two taking turns.

``"model": "self"`` in a draft_model config means the target itself (self-speculation:
every draft accepted, the mechanism's best case). ``--workload repeat`` makes prompts that
ask to repeat a given text twice (n-gram's real case); ``random`` keeps bench engine's
random-token prompts. A verify step (k + 1 rows a sequence) replays the decode CUDA
graphs where its rows fit the largest captured size (common/engine/spec_decode/verify_rows.py).

``--dspark K`` is method dspark with k = K; a DeepSeek-V4 checkpoint without a DSpark
module (a ``--shape``'s) is given a random one (``--dspark-stages`` stages,
common/model/fixtures/random_dspark.py ``v4_dspark_model``), written once into the model
cache beside it. A random module's drafts are almost never the target's tokens: its
acceptance is near zero and its tok/s the cost of drafting and verifying with nothing
gained, the floor of what a trained module buys. ``--dspark-bigram`` sets its Markov head
to a bigram table of the target's own greedy output on the run's prompts
(``bigram_markov_head``): drafts then follow the target's habits, some accepted.

Each row: decode tok/s with and without speculation, the step (ms, the host's share
included) and of it the target's forward (``forward ms``): without speculation a plain
decode step, with it the verify step of k + 1 rows a sequence (drafting is outside the
forward, inside the step); the acceptance; and whether greedy output with speculation
equals it without (the same prompts generated both ways, untimed: speculation must not
change greedy tokens; exit status 1 where a sequence differs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any


def progress(message: str) -> None:
    print(f"bench engine: {message}", file=sys.stderr, flush=True)


REPEAT_WORDS = (
    "river stone lantern quiet orbit maple signal copper harbor violet engine meadow "
    "falcon marble winter canyon ribbon pepper glacier anchor"
).split()


@dataclass
class SpecRow:
    batch: int
    base_decode_tok_s: float
    spec_decode_tok_s: float
    speedup: float
    base_step_ms: float
    spec_step_ms: float
    acceptance_rate: float  # accepted / drafted over the timed spec runs
    mean_accepted_length: float  # tokens per verify step, the bonus included
    base_forward_ms: float = 0.0  # of base_step_ms, the target's forward (a decode step)
    spec_forward_ms: float = 0.0  # of spec_step_ms, the target's forward (the verify)
    greedy_equal: int = 0  # sequences whose greedy tokens with speculation equal those without
    # over the timed spec runs: draft tokens proposed per sequence's verify step (k where
    # every step drafted a full block), and the verify steps sent without drafts because the
    # proposer's state had a gap (DSpark's windows: common/engine/spec_decode/stats.py)
    drafted_per_verify: float = 0.0
    deferred: int = 0


SPEC_COLUMNS = (
    ("batch", "batch", "{:d}"),
    ("base_decode_tok_s", "decode tok/s", "{:.1f}"),
    ("spec_decode_tok_s", "spec decode tok/s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("base_step_ms", "step ms", "{:.2f}"),
    ("spec_step_ms", "spec step ms", "{:.2f}"),
    ("base_forward_ms", "forward ms", "{:.2f}"),
    ("spec_forward_ms", "verify fwd ms", "{:.2f}"),
    ("acceptance_rate", "accepted", "{:.1%}"),
    ("mean_accepted_length", "tokens/verify", "{:.2f}"),
    ("drafted_per_verify", "drafted/verify", "{:.2f}"),
    ("greedy_equal", "greedy = base", "{:d}"),
)


def repeat_prompts(
    engine: Any, batch: int, prompt_len: int, seed: int, run: int
) -> list[list[int]]:
    """Chat prompts asking to repeat a random text of about ``prompt_len`` tokens."""
    rng = random.Random(f"repeat/{seed}/{batch}/{run}")
    tok = engine.tokenizer
    out = []
    for _ in range(batch):
        words: list[str] = []
        while len(tok.encode(" ".join(words), add_special_tokens=False)) < prompt_len // 2:
            words.append(rng.choice(REPEAT_WORDS))
        text = " ".join(words)
        ask = f"Repeat the following text twice, exactly:\n\n{text}\n\n{text}\n\n"
        out.append(tok.encode_chat([{"role": "user", "content": ask}]))
    return out


@contextlib.contextmanager
def speculation_off(engine: Any) -> Iterator[None]:
    """The baseline turns: the same engine (weights, cache, graphs) without drafts."""
    speculator, k = engine.speculator, engine.scheduler.num_speculative_tokens
    engine.speculator, engine.scheduler.num_speculative_tokens = None, 0
    try:
        yield
    finally:
        engine.speculator, engine.scheduler.num_speculative_tokens = speculator, k


def prompts_of(
    args: argparse.Namespace,
    engine: Any,
    batch: int,
    run: int,
    random_prompts: Callable[..., list[list[int]]],
) -> list[list[int]]:
    """Run ``run``'s prompts at ``batch`` (0: the warm-up's)."""
    if args.workload == "repeat":
        return repeat_prompts(engine, batch, args.prompt_len, args.seed, run)
    vocab = engine.model_config.vocab_size
    return random_prompts(vocab, batch, args.prompt_len, args.seed, run)


BIGRAM_RANK = 1024  # the Markov head's rank --dspark-bigram writes: the source tokens it holds


def bigram_markov_head(
    args: argparse.Namespace, engine: Any, random_prompts: Callable[..., list[list[int]]]
) -> int:
    """--dspark-bigram: the DSpark module's Markov head (its last stage's) set to a bigram
    table of the target's own greedy output on every prompt the run will time (each token
    to the one that most often follows it there; the BIGRAM_RANK most frequent tokens), so
    that drafts follow the target's habits: some accepted, some rejected, as a trained
    module's are. Returns the tokens the table holds."""
    from collections import Counter

    import torch

    from pdserve.common.engine.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=args.gen_len, ignore_eos=True)
    follow: dict[int, Counter[int]] = {}
    with speculation_off(engine):
        for batch in args.batch_sizes:
            for run in range(args.repeats + 1):
                progress(f"--dspark-bigram: greedy output at batch {batch}, run {run}")
                done = engine.generate(prompts_of(args, engine, batch, run, random_prompts), greedy)
                for c in done:
                    for a, b in zip(c.token_ids, c.token_ids[1:], strict=False):
                        follow.setdefault(a, Counter())[b] += 1
    head = engine.speculator.mtp.draft.last.markov_head
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight  # [vocab, rank] both
    rank = w1.shape[1]
    kept = sorted(follow.items(), key=lambda kv: -sum(kv[1].values()))[:rank]
    one = torch.zeros(w1.shape, dtype=torch.float32)
    table = torch.zeros(w2.shape, dtype=torch.float32)
    for n, (a, after) in enumerate(kept):
        one[a, n] = 1.0
        table[after.most_common(1)[0][0], n] = 20.0  # over the random head's logits
    w1.copy_(one.to(w1.device, w1.dtype))
    w2.copy_(table.to(w2.device, w2.dtype))
    return len(kept)


def bench_spec_batch(
    batch: int,
    args: argparse.Namespace,
    engine: Any,
    bench: Any,
    random_prompts: Callable[..., list[list[int]]],
) -> SpecRow:
    """``bench``: bench engine's EngineBench; ``random_prompts`` its prompts (passed in:
    bench_engine calls this module, so this module does not import it)."""

    def prompts(run: int) -> list[list[int]]:
        return prompts_of(args, engine, batch, run, random_prompts)

    stats = engine.speculator.stats
    progress(f"batch {batch}: warm-up")
    with speculation_off(engine):
        bench.run(prompts(0), args.gen_len)
    bench.run(prompts(0), args.gen_len)
    base, spec = [], []
    drafted0, accepted0, drafts0, deferred0 = (
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
        stats.num_drafts,
        stats.num_deferred,
    )
    for i in range(1, args.repeats + 1):
        progress(f"batch {batch}: run {i}/{args.repeats}")
        with speculation_off(engine):
            base.append(bench.run(prompts(i), args.gen_len)[0])
        spec.append(bench.run(prompts(i), args.gen_len)[0])
    drafted = stats.num_draft_tokens - drafted0
    accepted = stats.num_accepted_tokens - accepted0
    verifies = stats.num_drafts - drafts0
    deferred = stats.num_deferred - deferred0

    def tok_s(t: Any) -> float:
        return float(t.decode_tokens / t.decode_s)

    def step_ms(t: Any) -> float:
        return float(t.decode_s / max(t.decode_steps, 1) * 1e3)

    def forward_ms(t: Any) -> float:
        return float(t.model_s / max(t.decode_steps, 1) * 1e3)

    progress(f"batch {batch}: greedy tokens with and without speculation")
    from pdserve.common.engine.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=args.gen_len, ignore_eos=True)
    with speculation_off(engine):
        want = [c.token_ids for c in engine.generate(prompts(1), greedy)]
    got = [c.token_ids for c in engine.generate(prompts(1), greedy)]
    base_tok_s = statistics.median(tok_s(t) for t in base)
    spec_tok_s = statistics.median(tok_s(t) for t in spec)
    return SpecRow(
        batch=batch,
        base_decode_tok_s=base_tok_s,
        spec_decode_tok_s=spec_tok_s,
        speedup=spec_tok_s / base_tok_s,
        base_step_ms=statistics.median(step_ms(t) for t in base),
        spec_step_ms=statistics.median(step_ms(t) for t in spec),
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted_length=1 + accepted / verifies if verifies else 0.0,
        base_forward_ms=statistics.median(forward_ms(t) for t in base),
        spec_forward_ms=statistics.median(forward_ms(t) for t in spec),
        greedy_equal=sum(g == w for g, w in zip(got, want, strict=True)),
        drafted_per_verify=drafted / verifies if verifies else 0.0,
        deferred=deferred,
    )


def spec_config_of(args: argparse.Namespace) -> Any:
    from pdserve.common.engine.spec_decode.config import parse_speculative_config

    if getattr(args, "dspark", None) is not None:
        raw: Any = {"method": "dspark", "num_speculative_tokens": args.dspark}
        return parse_speculative_config(json.dumps(raw))
    raw = json.loads(args.speculative_config)
    if isinstance(raw, dict) and raw.get("model") == "self":
        raw["model"] = args.model  # the target (after --shape made it)
    return parse_speculative_config(json.dumps(raw))


def run_spec(
    args: argparse.Namespace,
    engine: Any,
    bench: Any,
    random_prompts: Callable[..., list[list[int]]],
    format_table: Callable[..., str],
) -> int:
    bigram = None
    if getattr(args, "dspark_bigram", False):
        bigram = bigram_markov_head(args, engine, random_prompts)
    rows = [bench_spec_batch(b, args, engine, bench, random_prompts) for b in args.batch_sizes]
    spec = engine.config.speculative_config
    graphs = getattr(engine.runner, "graphs", None) is not None
    print(
        f"model {engine.model_dir}  device {args.device}  workload {args.workload}  "
        f"prompt_len {args.prompt_len}  gen_len {args.gen_len}  repeats {args.repeats}  "
        f"cuda graphs {'on' if graphs else 'off'}\n"
        f"speculative_config {json.dumps({k: v for k, v in asdict_spec(spec).items() if v is not None})}"
    )
    print(format_table(rows, SPEC_COLUMNS))  # type: ignore[arg-type]
    for r in rows:
        if r.drafted_per_verify == 0:
            print(f"batch {r.batch}: no drafts were proposed ({r.deferred} verify steps "
                  "deferred): its speculative columns are plain decode steps")  # fmt: skip
        if r.greedy_equal != r.batch:
            print(f"batch {r.batch}: greedy tokens with speculation differ from those without "
                  f"in {r.batch - r.greedy_equal} of {r.batch} sequences")  # fmt: skip
    if bigram is not None:
        print(f"the DSpark module is random, its Markov head a bigram table of {bigram} tokens "
              "of the target's own greedy output on these prompts: its acceptance is that "
              "table's, not a trained module's")  # fmt: skip
    elif spec.method == "dspark" and getattr(args, "dspark_random", False):
        print("the DSpark module is random (none in the checkpoint): acceptance near zero, "
              "the speculative rows the cost of drafting and verifying with nothing gained")  # fmt: skip
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        from pdserve.cli.provenance import provenance

        payload = {
            "benchmark": "engine_spec",
            "config": {
                **provenance(),
                "model_dir": str(engine.model_dir),
                "shape": args.shape,
                "device": args.device,
                "workload": args.workload,
                "prompt_len": args.prompt_len,
                "gen_len": args.gen_len,
                "repeats": args.repeats,
                "speculative_config": asdict_spec(spec),
                "dspark_random": bool(getattr(args, "dspark_random", False)),
                "dspark_stages": getattr(args, "dspark_stages", None),
                "dspark_bigram_tokens": bigram,
                "cuda_graphs": graphs,
                "loadavg_1m_end": os.getloadavg()[0],
            },
            "rows": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        progress(f"wrote {args.json}")
    return 1 if any(r.greedy_equal != r.batch for r in rows) else 0


def asdict_spec(spec: Any) -> dict[str, Any]:
    import msgspec

    return dict(msgspec.to_builtins(spec))

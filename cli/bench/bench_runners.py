"""The two sides ``pdserve bench engine`` times on the same prompts: the monolithic engine
(`EngineBench`) and Hugging Face transformers (`HFBench`), each giving a `Timing`.
Stdlib-only at import time; torch and transformers are imported where used."""

from __future__ import annotations

import inspect
import itertools
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pdserve.common.engine.llm_engine import LLMEngine

Sync = Callable[[], None]


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
        from pdserve.common.model.layers.moe import record_expert_usage

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

        # With asynchronous scheduling the host must not wait for a forward (that would
        # undo the overlap): CUDA events time it on the device instead.
        overlapped = runner.device.type == "cuda" and self.engine.is_async_scheduling
        marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

        def count_touched() -> None:
            # device ops, no sync, after the step's forward on the same stream: the
            # (layer, expert) pairs this step read (with or without the overlap: it was
            # only counted without it, so the overlapped CUDA runs printed 0)
            if touched is not None:
                touched.add_(torch.stack([b.touched for b in blocks]).sum())

        def timed_execute(plan, *args):  # noqa: ANN001, ANN002, ANN202
            nonlocal model_s
            for block in blocks:  # device ops, no sync: which experts this step reads
                assert block.touched is not None
                block.touched.zero_()
            if overlapped:
                begin, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                begin.record()
                logits = execute(plan, *args)
                end.record()
                marks.append((begin, end))
                count_touched()
                return logits
            start = time.perf_counter()
            logits = execute(plan, *args)
            self.sync()  # sampling syncs right after anyway: this moves the wait, adds none
            model_s += time.perf_counter() - start
            count_touched()
            return logits

        runner.execute = timed_execute  # type: ignore[method-assign]
        try:
            self.sync()
            start = time.perf_counter()
            tokens = steps = 0
            while self.engine.has_unfinished:
                tokens += sum(len(out.new_token_ids) for out in self.engine.step())
                steps += self.engine.last_step_launched  # not a call that only read tokens
            self.sync()
        finally:
            del runner.execute  # the bound method again
        elapsed = time.perf_counter() - start
        model_s += sum(begin.elapsed_time(end) for begin, end in marks) / 1e3
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
            out = self._generate(input_ids, mask, gen_len)
            self.sync()
        seconds = time.perf_counter() - start
        if out.shape[1] != input_ids.shape[1] + gen_len:
            made = out.shape[1] - input_ids.shape[1]
            raise RuntimeError(f"HF generated {made} tokens, not {gen_len}")
        return seconds

    def greedy(self, prompts: Sequence[Sequence[int]], gen_len: int) -> list[list[int]]:
        """generate()'s greedy tokens, ``gen_len`` a prompt (bench engine --compare-tokens)."""
        import torch

        input_ids, mask = self._inputs(prompts)
        with torch.inference_mode():
            out = self._generate(input_ids, mask, gen_len)
        return [row[input_ids.shape[1] :].tolist() for row in out]

    def _generate(self, input_ids: Any, mask: Any, gen_len: int) -> Any:
        """HF generate(), greedy, exactly ``gen_len`` new tokens a prompt."""
        return self.model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=gen_len,
            min_new_tokens=gen_len,
            do_sample=False,
            use_cache=True,
            pad_token_id=self.pad_token_id,
        )

    def run(self, prompts: Sequence[Sequence[int]], gen_len: int) -> Timing:
        prefill_s = self.prefill(prompts)
        generate_s = self.generate(prompts, gen_len)
        # generate() = one prefill + (gen_len - 1) decode forwards (+ its own overhead,
        # which counts against decode: a server pays it too).
        return Timing(prefill_s, generate_s - prefill_s, len(prompts) * (gen_len - 1))

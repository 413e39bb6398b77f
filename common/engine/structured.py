"""Grammar-constrained sampling (structured output) with xgrammar, on CPU or GPU logits.

One ``GrammarMatcher`` per request, made on the first step that samples for it and fed
the request's output tokens so far: on prefill that is the first token; on decode the
matcher first takes the token prefill sampled, so both services constrain the same
sequence without shipping matcher state. Each step fills the row's token bitmask, masks
the logits (before penalties and sampling), and the matcher then accepts the chosen
token. Once the grammar is complete only a stop token is allowed. A reasoning model's
grammar (``StructuredOutput.think_end_id``) has no matcher while the model thinks; the
first step after the end marker makes it from the tokens after the marker, on either
service alike.

xgrammar (and transformers, for the tokenizer's vocabulary) are imported on the first
structured request, so engines that never see one do not pay the ~10 s import. Measured
cost on the embedded model: compiling a small JSON schema ~30 ms (cached by xgrammar),
filling one bitmask ~0.1 ms a token.

Compiling is off the engine thread (issue 50: a schema 360 levels deep compiled for
seconds there, and every other stream stalled that long). ``request`` starts a grammar's
compile on the table's worker thread (xgrammar's compile releases the GIL, so the engine
thread steps on meanwhile) and says whether it is ready; the engine thread keeps such a
request out of its engine (no batch slot, no blocks) until it is, or until its deadline
(common/runtime/engine_thread.py: ``grammar_ready``), then ``compile`` gives the result
from the table's cache (keyed by the constraint), a bad or over-limit one as a
RequestError. Before xgrammar sees a JSON schema it is checked against MAX_SPEC_CHARS and
MAX_SCHEMA_DEPTH (iteratively): a schema past either is refused naming the limit.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from pdserve.common.engine.sampling_params import StructuredOutput
from pdserve.common.errors import RequestError

# A constraint's text at most (a JSON schema, regex or grammar), and a JSON schema's
# nesting (lists and objects) at most: xgrammar's compile time grows steeply with depth
# (issue 50: 200 schema levels 1 s, 400 levels 7.7 s on the 2-core test machine).
MAX_SPEC_CHARS = 1 << 20
MAX_SCHEMA_DEPTH = 128
CACHE_SIZE = 256  # compiled grammars (and refusals) kept, least recently used dropped
COMPILE_WORKERS = 2  # one runaway compile leaves the other worker to the next ones
COMPILE_NICE = 10  # the workers' nice value (Linux): below the engine thread's share

Key = tuple[str, str]


def key_of(spec: StructuredOutput) -> Key:
    return (spec.kind, spec.spec)


class GrammarTable:
    def __init__(self, model_dir: Path, vocab_size: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._xgr: Any = None
        self._compiler: Any = None
        self._load_lock = threading.Lock()
        self._matchers: dict[str, Any] = {}
        # Touched by the engine thread only; the workers just run _compile_now.
        self._results: OrderedDict[Key, Any] = OrderedDict()  # grammar, or a RequestError
        self._pending: dict[Key, Future[Any]] = {}
        self._expired: dict[Key, str] = {}  # one-shot refusals: a request's deadline passed
        self._executor: ThreadPoolExecutor | None = None

    # -- compiling, off the engine thread ---------------------------------------------------

    def request(self, spec: StructuredOutput, wake: Any = None) -> bool:
        """Whether ``spec``'s grammar (or its refusal) is ready; if not, its compile is
        started on a worker (once per constraint) and ``wake()`` is called when it ends."""
        key = key_of(spec)
        if key in self._results:
            return True
        future = self._pending.get(key)
        if future is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(COMPILE_WORKERS, "grammar-compile")
            future = self._executor.submit(self._compile_now, spec)
            self._pending[key] = future
        if future.done():
            self._harvest(key, future)
            return True
        if wake is not None:
            future.add_done_callback(lambda _: wake())
        return False

    @property
    def loaded(self) -> bool:
        """xgrammar imported and the tokenizer's vocabulary read (the first compile's)."""
        return self._compiler is not None

    def expire(self, spec: StructuredOutput, message: str) -> None:
        """The next ``compile(spec)`` raises RequestError(message): a waiting request's
        deadline passed (its compile, still running, is kept for the next request)."""
        self._expired[key_of(spec)] = message

    def _harvest(self, key: Key, future: Future[Any]) -> None:
        del self._pending[key]
        try:
            result = future.result()
        except RequestError as exc:
            result = exc
        except Exception as exc:  # noqa: BLE001 - a request's fault, never the engine's
            result = RequestError(f"the structured output constraint does not compile: {exc}")
        self._results[key] = result
        while len(self._results) > CACHE_SIZE:
            self._results.popitem(last=False)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _load(self) -> None:
        if self._compiler is not None:
            return
        with self._load_lock:
            if self._compiler is None:
                self._load_locked()

    def _load_locked(self) -> None:
        try:
            import xgrammar as xgr
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise RequestError(
                "structured output needs the xgrammar package where prefill and decode run "
                f"(pip install xgrammar): {exc}"
            ) from None
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        self._xgr, self._compiler = xgr, xgr.GrammarCompiler(info)

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar, from the table's cache (compiled here, on the caller's
        thread, if ``request`` never started it); a bad spec is a RequestError."""
        key = key_of(spec)
        expired = self._expired.pop(key, None)
        if expired is not None:
            raise RequestError(expired)
        future = self._pending.get(key)
        if future is not None:
            future.result()  # wait for the worker's (the engine thread never gets here)
            self._harvest(key, future)
        if key not in self._results:
            try:
                self._results[key] = self._compile_now(spec)
            except RequestError as exc:
                self._results[key] = exc
        self._results.move_to_end(key)
        result = self._results[key]
        if isinstance(result, RequestError):
            raise RequestError(str(result))
        return result

    def _compile_now(self, spec: StructuredOutput) -> Any:
        """xgrammar's compile of ``spec``, within the limits (on a worker thread)."""
        if len(spec.spec) > MAX_SPEC_CHARS:
            raise RequestError(f"the {spec.kind} constraint has {len(spec.spec)} characters, "
                               f"more than {MAX_SPEC_CHARS} (the server's limit)")  # fmt: skip
        if spec.kind == "json":
            check_schema_depth(spec.spec)
        # xgrammar's first load runs at the thread's normal priority: its imports hold
        # the GIL, which a deprioritised thread would keep the engine thread waiting for
        self._load()
        _lower_priority()
        compiler = self._compiler
        try:
            if spec.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.spec, any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                choices = json.loads(spec.spec)
                return compiler.compile_grammar("root ::= " + " | ".join(map(json.dumps, choices)))
            if spec.kind == "grammar":
                return compiler.compile_grammar(spec.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = " ".join(str(exc).split())[:500]
            raise RequestError(f"the {spec.kind} constraint does not compile: {message}") from None
        raise RequestError(f"unknown structured output kind {spec.kind!r}")

    def mask(
        self,
        logits: torch.Tensor,  # [V], masked in place
        request_id: str,
        spec: StructuredOutput,
        output: Sequence[int],
    ) -> None:
        matcher = self._matchers.get(request_id)
        if matcher is None:
            constrained = spec.constrained(output)
            if constrained is None:  # a reasoning model thinking: free until its end marker
                return
            matcher = self._xgr_matcher(spec)
            for token in constrained:  # decode: the token(s) sampled elsewhere first
                matcher.accept_token(token)
            self._matchers[request_id] = matcher
        xgr = self._xgr
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)  # [1, ceil(V / 32)] int32
        matcher.fill_next_token_bitmask(bitmask, 0)
        if spec.think_start_id is not None and not output:  # the model may open its thinking
            word, bit = divmod(spec.think_start_id, 32)
            bitmask[0, word] |= _bit(bit)
        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits[None], bitmask)
        else:
            xgr.apply_token_bitmask_inplace(logits[None], bitmask.to(logits.device))

    def _xgr_matcher(self, spec: StructuredOutput) -> Any:
        compiled = self.compile(spec)  # loads xgrammar on first use
        return self._xgr.GrammarMatcher(compiled)

    def accept(self, request_id: str, token: int, spec: StructuredOutput,
               output: Sequence[int]) -> None:  # fmt: skip
        """``token`` sampled after ``output``."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        if not output and token == spec.think_start_id:
            # it opened its thinking: the grammar waits for the end marker (mask makes
            # the matcher anew then, from the tokens after it)
            del self._matchers[request_id]
        elif not matcher.is_terminated():
            matcher.accept_token(token)

    def prune(self, live: Iterable[str]) -> None:
        """Forget matchers of requests that ended (finished, aborted, handed to decode)."""
        keep = set(live)
        for request_id in [r for r in self._matchers if r not in keep]:
            del self._matchers[request_id]

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)


def _lower_priority() -> None:
    """A compile worker yields the CPU to the engine thread (Linux: a thread's nice value
    is its own): a long compile (which releases the GIL) takes what the steps leave."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: the default priority
        pass


def check_schema_depth(text: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """RequestError when the JSON ``text`` nests more than ``limit`` lists and objects deep
    (counted without recursion: neither json.loads nor xgrammar sees such a schema)."""
    depth = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub("", text)):
        if bracket in "[{":
            depth += 1
            if depth > limit:
                raise RequestError(f"the JSON schema is nested more than {limit} lists and "
                                   "objects deep (the server's limit for a structured output "
                                   "schema); flatten it")  # fmt: skip
        else:
            depth -= 1


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def _bit(index: int) -> int:
    """Bit ``index`` of an int32 bitmask word, as the signed value torch stores."""
    return (1 << index) - (1 << 32) if index == 31 else 1 << index

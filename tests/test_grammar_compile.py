"""Grammars compiled off the engine thread (issue 50; common/engine/structured.py,
common/runtime/engine_thread.py): a request waits for its grammar out of the engine
while the thread keeps turning, the compile's budget refuses it naming
``grammar_compile_timeout_seconds``, a schema past the depth or size limit is refused
naming it, and the compile is cached by the constraint. Real xgrammar, the embedded
model's tokenizer; the one fake is a slower compile (a wrapper that sleeps first)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from pdserve.common.engine.sampling_params import SamplingParams, StructuredOutput
from pdserve.common.engine.structured import (
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_CHARS,
    GrammarTable,
    check_schema_depth,
)
from pdserve.common.errors import RequestError
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.engine_commands import Prefill
from pdserve.common.runtime.engine_thread import EngineContext, EngineThread
from pdserve.common.runtime.metrics import Metrics
from pdserve.common.runtime.service_config import DeploymentConfig

pytest.importorskip("xgrammar")
VOCAB = 49152


def nested(levels: int) -> str:
    schema: dict[str, Any] = {"type": "string"}
    for i in range(levels):
        schema = {"type": "object", "properties": {f"p{i % 10}": schema}}
    return json.dumps(schema)


def spec(levels: int = 3) -> StructuredOutput:
    return StructuredOutput(kind="json", spec=nested(levels))


@pytest.fixture(scope="module")
def table(real_model_dir: Path) -> Any:
    grammars = GrammarTable(real_model_dir, VOCAB)
    yield grammars
    grammars.close()


def _wait(table: GrammarTable, s: StructuredOutput, timeout: float = 120) -> None:
    woke = threading.Event()
    if not table.request(s, woke.set):
        assert woke.wait(timeout)
        assert table.request(s)


def test_request_compiles_on_a_worker_and_caches(table: GrammarTable) -> None:
    s = spec(5)
    woke = threading.Event()
    ready = table.request(s, woke.set)
    if not ready:  # the worker's (xgrammar's first load included)
        assert woke.wait(120)
    assert table.request(s)  # ready now, and cached: no second compile
    grammar = table.compile(s)
    assert grammar is table.compile(StructuredOutput(kind="json", spec=s.spec))
    assert table.loaded


def test_schemas_past_the_limits_are_refused_naming_them(table: GrammarTable) -> None:
    deep = spec(MAX_SCHEMA_DEPTH)  # 2 levels a property: twice the limit
    _wait(table, deep)
    with pytest.raises(RequestError, match=f"nested more than {MAX_SCHEMA_DEPTH}"):
        table.compile(deep)
    big = StructuredOutput(kind="regex", spec="a" * (MAX_SPEC_CHARS + 1))
    _wait(table, big)
    with pytest.raises(RequestError, match=f"more than {MAX_SPEC_CHARS}"):
        table.compile(big)
    check_schema_depth(nested(MAX_SCHEMA_DEPTH // 2 - 1))  # within: no error
    # brackets inside strings are text, not nesting
    check_schema_depth(json.dumps({"enum": ["[" * 500, "{" * 500]}))
    with pytest.raises(RequestError):
        check_schema_depth("[" * (MAX_SCHEMA_DEPTH + 1))


def test_an_expired_wait_is_refused_once(table: GrammarTable, monkeypatch: Any) -> None:
    slow = spec(7)
    real = table._compile_now

    def slower(s: StructuredOutput) -> Any:
        time.sleep(1.0)
        return real(s)

    monkeypatch.setattr(table, "_compile_now", slower)
    assert not table.request(slow)
    table.expire(slow, "past the budget")
    with pytest.raises(RequestError, match="past the budget"):
        table.compile(slow)
    _wait(table, slow)  # the compile went on: the next request of it is served
    assert table.compile(slow) is not None


# -- the engine thread: waiting out of the engine ----------------------------------------------


class FakeEngine:
    """Records what reached it; a structured request's grammar comes from the table, as
    EngineCore.validate takes it."""

    def __init__(self, grammars: GrammarTable) -> None:
        self.sampler = SimpleNamespace(grammars=grammars)
        self.events: list[tuple[str, str, float]] = []


class Thread(EngineThread):
    def __init__(self, ctx: EngineContext, grammars: GrammarTable) -> None:
        super().__init__(ctx, asyncio.new_event_loop(), "test-engine")
        self.engine = FakeEngine(grammars)
        self.handlers[Prefill] = self._on_prefill
        self.turns = 0

    def _on_prefill(self, cmd: Prefill) -> None:
        req = cmd.request
        if not self.grammar_ready(cmd, req.request_id, req.sampling):
            return
        try:
            if req.sampling.structured is not None:
                self.engine.sampler.grammars.compile(req.sampling.structured)
            self.engine.events.append(("added", req.request_id, time.monotonic()))
        except RequestError as exc:
            self.engine.events.append(("failed:" + str(exc), req.request_id, time.monotonic()))

    def run_once(self) -> bool:
        self.turns += 1
        return False


def _prefill(request_id: str, structured: StructuredOutput | None) -> Prefill:
    sampling = SamplingParams(structured=structured)
    request = p.PrefillRequest(request_id=request_id, trace_id=request_id,
                               prompt_token_ids=[1, 2], sampling=sampling)  # fmt: skip
    return Prefill(identity=b"r", request=request)


def test_the_engine_thread_turns_while_a_grammar_compiles(
    table: GrammarTable, monkeypatch: Any
) -> None:
    _wait(table, spec(2))  # xgrammar loaded: the budget counts from the wait's start
    cfg = msgspec.structs.replace(DeploymentConfig(), grammar_compile_timeout_seconds=0.5)
    ctx = EngineContext(cfg=cfg, instance=0, torch_threads=1, metrics=Metrics("test", 0),
                        reply=lambda identity, msg: None)  # fmt: skip
    real = table._compile_now

    delays = {spec(11).spec: 2.0, spec(12).spec: 0.2}

    def slow(s: StructuredOutput) -> Any:
        time.sleep(delays.get(s.spec, 0.0))
        return real(s)

    monkeypatch.setattr(table, "_compile_now", slow)
    thread = Thread(ctx, table)
    thread.start()
    assert thread.ready.wait(10)
    try:
        start = time.monotonic()
        thread.submit(_prefill("too-slow", spec(11)))  # 2 s: past the 0.5 s budget
        thread.submit(_prefill("quick", spec(12)))  # 0.2 s: within it
        thread.submit(_prefill("plain", None))
        deadline = time.monotonic() + 30
        while len(thread.engine.events) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        turns = thread.turns
    finally:
        thread.stop()
        thread.join(10)
    events = {rid: (what, at - start) for what, rid, at in thread.engine.events}
    assert events["plain"][0] == "added"
    assert events["quick"][0] == "added"
    assert events["too-slow"][0].startswith("failed:"), events
    assert "grammar_compile_timeout_seconds" in events["too-slow"][0]
    assert "0.5 s" in events["too-slow"][0]
    # the plain request did not wait behind the compiles; the thread kept turning
    assert events["plain"][1] < events["quick"][1] < events["too-slow"][1]
    assert turns > 10
    assert not thread._parked

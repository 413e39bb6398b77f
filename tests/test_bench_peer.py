"""``pdserve bench serve --peer-url`` (cli/bench/bench_peer.py): the peer gets the very requests
pdserve got, load for load, over real sockets; its runs join the table, JSON and plot.

Two small OpenAI servers (aiohttp, on real ports) record what they receive; the slow test
puts a real deployment in pdserve's place. No assert on speed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from pdserve.cli.main import main
from tests.e2e import deployment


@contextmanager
def openai_server(name: str, vocab: int | None) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A server that streams ``max_tokens`` chunks and records every completion body."""
    bodies: list[dict[str, Any]] = []

    async def models(request: web.Request) -> web.Response:
        card = {"id": name, "object": "model", "max_model_len": 4096}
        return web.json_response({"object": "list", "data": [card | ({"vocab_size": vocab}
                                                                      if vocab else {})]})  # fmt: skip

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": "y", "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", bodies
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_peer_gets_the_same_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "serve.json"
    with openai_server("ours", vocab=500) as (url, ours), \
            openai_server("their-model", vocab=None) as (peer, theirs):  # fmt: skip
        rc = main(["bench", "serve", "--url", url, "--peer-url", peer, "--peer-label", "vllm",
                   "--num-prompts", "3", "--input-len", "8", "--output-len", "2",
                   "--max-concurrency", "1,2", "--label", "pdserve", "--num-warmups", "0",
                   "--json", str(out)])  # fmt: skip
    assert rc == 0
    # warm-up + 3 prompts per load, each side; the peer got pdserve's prompts (ids below
    # pdserve's vocabulary of 500, not the fallback range a card without one gives): in order
    # at c=1; at c=2 two requests race, so the same prompts in some order
    assert len(ours) == len(theirs) == 8
    sent, got = [b["prompt"] for b in ours], [b["prompt"] for b in theirs]
    assert got[:4] == sent[:4] and sorted(got[4:]) == sorted(sent[4:])
    assert all(0 <= t < 500 for b in theirs for t in b["prompt"])
    assert all(b["model"] == "their-model" for b in theirs)  # the peer is told its model
    assert all("model" not in b for b in ours)
    assert all(b["max_tokens"] == 2 and b["ignore_eos"] for b in theirs)
    payload = json.loads(out.read_text())
    assert payload["config"]["peer_url"] == peer
    runs = payload["runs"]
    assert [(r["label"], r["mode"], r["load"]) for r in runs] == [
        ("pdserve c=1", "pdserve", 1), ("pdserve c=2", "pdserve", 2),
        ("vllm c=1", "vllm", 1), ("vllm c=2", "vllm", 2)]  # fmt: skip
    assert all(r["metrics"]["completed"] == 3 for r in runs)
    assert runs[2]["server"]["model"] == "their-model" and runs[2]["peer"]
    header = capsys.readouterr().out.splitlines()[1]
    assert "vllm c=1" in header and "pdserve c=2" in header
    from benchmarks.plot_serve import main as plot

    plot(str(out), str(tmp_path / "serve.png"))  # one line per mode, the peer's included
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_modes_flag_names_known_deployments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--compare", "--modes", "colocated,split"])
    assert "unknown mode(s) split" in capsys.readouterr().err


@pytest.mark.slow
def test_peer_beside_a_deployment(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    with deployment(tmp_path / "dep", model_dir) as dep, \
            openai_server("peer-model", vocab=None) as (peer, theirs):  # fmt: skip
        rc = main(["bench", "serve", "--url", dep.url, "--peer-url", peer, "--num-prompts", "2",
                   "--input-len", "16", "--output-len", "3", "--json", str(out)])  # fmt: skip
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["mode"] for r in runs] == ["serve", "peer"]
    vocab = runs[0]["server"]["vocab_size"]  # the router's, which the peer's prompts follow
    assert runs[1]["server"]["token_id_range"] == [0, vocab]
    # the peer warmed too (lengths 16 and 15, bursts of 2), all in pdserve's id range
    assert all(max(b["prompt"]) < vocab for b in theirs)
    assert [len(b["prompt"]) for b in theirs] == [16, 15, 16, 16, 16, 16] + [16] * 3
    assert runs[1]["metrics"]["completed"] == 2 and runs[0]["metrics"]["completed"] == 2

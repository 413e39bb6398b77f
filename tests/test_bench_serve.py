"""``pdserve bench serve``: the metrics on synthetic timestamps, the client against a fake
server (failures are counted, never fatal), and one small run against a real deployment.

Timings on a shared machine mean nothing, so no test asserts on speed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from pdserve.cli.bench.bench_serve import format_table
from pdserve.cli.bench.serve_load import (
    Load,
    RequestRecord,
    Workload,
    arrival_offsets,
    compute_metrics,
    conversations,
    make_prompts,
    percentile,
    prompt_lengths,
    prompts_of_lengths,
    warmup_plan,
)
from pdserve.cli.main import main
from pdserve.common.runtime.ttft import PARTS
from tests.e2e import deployment
from tests.test_bench_peer import openai_server


def record(i: int, ttft: float, e2e: float, itl: list[float], out: int = 4) -> RequestRecord:
    return RequestRecord(i, ok=True, prompt_tokens=10, output_tokens=out, ttft_s=ttft, e2e_s=e2e,
                         itl_s=itl)  # fmt: skip


def test_metrics_follow_vllm_definitions() -> None:
    records = [
        record(0, 0.1, 0.4, [0.1, 0.1, 0.1]),
        record(1, 0.3, 0.9, [0.2, 0.2, 0.2]),
        RequestRecord(2, error="HTTP 503: peer down", prompt_tokens=10),
    ]
    m = compute_metrics(records, duration_s=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (20, 8)  # failed: not counted
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(14.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)  # 100 + 0.9 * (300 - 100)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    # TPOT per request: (e2e - ttft) / (out - 1) = 100 ms and 200 ms.
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    assert m["p99_tpot_ms"] == pytest.approx(199.0)
    # ITL pools every gap of every request: three of 100 ms, three of 200 ms.
    assert m["mean_itl_ms"] == pytest.approx(150.0)
    assert m["median_itl_ms"] == pytest.approx(150.0)
    assert m["p90_itl_ms"] == pytest.approx(200.0)
    assert m["mean_e2el_ms"] == pytest.approx(650.0)


def test_metrics_without_values_are_none_not_zero() -> None:
    one_token = compute_metrics([record(0, 0.1, 0.1, [], out=1)], duration_s=1.0)
    assert one_token["mean_tpot_ms"] is None and one_token["mean_itl_ms"] is None
    assert one_token["mean_ttft_ms"] == pytest.approx(100.0)
    nothing = compute_metrics([RequestRecord(0, error="boom")], duration_s=1.0)
    assert (nothing["completed"], nothing["failed"], nothing["output_throughput"]) == (0, 1, 0)
    assert nothing["p99_e2el_ms"] is None
    assert "-" in format_table([{"label": "x", "metrics": nothing}])


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_arrivals_are_seeded_poisson_or_all_at_once() -> None:
    assert arrival_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
    a = arrival_offsets(2000, 10.0, 7)
    assert a == arrival_offsets(2000, 10.0, 7) and a != arrival_offsets(2000, 10.0, 8)
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.1, rel=0.1)  # mean gap 1 / rate


def test_burstiness_shapes_the_gaps_not_their_mean() -> None:
    for shape in (0.25, 1.0, 4.0):  # the gaps' coefficient of variation is 1 / sqrt(shape)
        a = arrival_offsets(4000, 10.0, 3, burstiness=shape)
        gaps = [y - x for x, y in itertools.pairwise(a)]
        mean = sum(gaps) / len(gaps)
        cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
        assert mean == pytest.approx(0.1, rel=0.1) and cv == pytest.approx(shape**-0.5, rel=0.15)
    # one pattern for every rate of a sweep, compressed: rates differ only in their rate
    slow, fast = arrival_offsets(50, 1.0, 3, 0.5), arrival_offsets(50, 4.0, 3, 0.5)
    assert fast == pytest.approx([x / 4 for x in slow])


def test_lognormal_lengths_are_seeded_long_tailed_and_capped() -> None:
    w = Workload(dist="lognormal", input_len=200, output_len=50, max_output_len=120)
    lengths = w.lengths(2000, seed=1)
    assert lengths == w.lengths(2000, seed=1) and lengths != w.lengths(2000, seed=2)
    ins, outs = sorted(i for i, _ in lengths), sorted(o for _, o in lengths)
    assert 180 <= ins[1000] <= 220 and 45 <= outs[1000] <= 55  # the medians
    assert ins[1800] > 3 * ins[1000]  # sigma 1: the 90th percentile ~3.6x the median
    assert min(ins) >= 1 and max(ins) <= 1600 and min(outs) >= 1 and max(outs) == 120
    assert w.longest == 1600 + 120
    fixed = Workload(input_len=8, output_len=3)
    assert fixed.lengths(2, seed=0) == [(8, 3), (8, 3)] and fixed.longest == 11
    prompts = prompts_of_lengths([i for i, _ in lengths[:20]], (0, 1000), seed=0)
    assert [len(p) for p in prompts] == [i for i, _ in lengths[:20]]


def test_a_load_is_named_by_what_the_sweep_varies() -> None:
    rates = [Load(1.0, None), Load(2.5, None)]
    assert [x.name("colocated", rates) for x in rates] == ["colocated r=1", "colocated r=2.5"]
    both = [Load(1.0, 4), Load(math.inf, 8)]
    assert both[1].name("d", both) == "d r=inf c=8" and both[0].name("d", both[:1]) == "d"


def test_prompts_are_exact_distinct_and_in_range() -> None:
    prompts = make_prompts(16, 32, (1000, 30000), seed=0)
    assert prompts == make_prompts(16, 32, (1000, 30000), seed=0)
    assert all(len(p) == 32 and all(1000 <= t < 30000 for t in p) for p in prompts)
    assert len({p[0] for p in prompts}) > 1 and len({tuple(p) for p in prompts}) == 16
    assert make_prompts(1, 32, (1000, 30000), seed=0, stream="warm-up")[0] not in prompts
    # a longer run with the same seed shares no prefix with a shorter one (a peer server
    # kept between runs would otherwise serve it from its prefix cache)
    longer = make_prompts(8, 64, (1000, 30000), seed=0)
    assert not {tuple(p[:32]) for p in longer} & {tuple(p) for p in prompts}


# -- a fake server: every other request fails, the rest stream four tokens -------------


def fake_app() -> web.Application:
    seen = {"n": 0}

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "fake", "object": "model", "created": 0, "owned_by": "t", "max_model_len": 512}
        ]})  # fmt: skip

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen["n"] += 1
        if seen["n"] % 2 == 0:  # the warm-up is request 1: it succeeds
            return web.json_response({"error": {"message": "overloaded"}}, status=429)
        assert body["ignore_eos"] and body["stream"] and body["stream_options"]["include_usage"]
        assert all(1000 <= t < 30000 for t in body["prompt"])  # no vocabulary: the fallback
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(0.005)
            chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"],
                 "total_tokens": len(body["prompt"]) + body["max_tokens"]}  # fmt: skip
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


@pytest.fixture
def fake_url() -> Iterator[str]:
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(fake_app())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_failures_are_recorded_not_fatal(fake_url: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    out = tmp_path / "serve.json"
    monkeypatch.setenv("PDSERVE_DECODE_TORCH_THREADS", "2")  # changes a run as a flag does
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-do-not-record")
    monkeypatch.setenv("PDSERVE_ENGINE__MAX_NUM_BATCHED_TOKENS", "128")  # no secret
    rc = main(["bench", "serve", "--url", fake_url, "--num-prompts", "4", "--input-len", "8",
               "--output-len", "3", "--max-concurrency", "1", "--num-warmups", "0",
               "--json", str(out)])  # fmt: skip
    assert rc == 1  # failures make the exit status non-zero, after the table and the JSON
    payload = json.loads(out.read_text())
    # how the results were made: the commit ("unknown" without git) and the command as typed
    config = payload["config"]
    assert config["command"].startswith(f"pdserve bench serve --url {fake_url} ")
    assert config["git_commit"] == "unknown" or len(config["git_commit"]) >= 40
    # and the PDSERVE_* settings it ran under, a secret's value left out
    assert config["environment"]["PDSERVE_DECODE_TORCH_THREADS"] == "2"
    assert config["environment"]["PDSERVE_API_KEY"] == "<set>"
    assert config["environment"]["PDSERVE_ENGINE__MAX_NUM_BATCHED_TOKENS"] == "128"
    assert "sk-do-not-record" not in out.read_text()
    [run] = payload["runs"]
    assert (run["metrics"]["completed"], run["metrics"]["failed"]) == (2, 2)
    failed = [r for r in run["requests"] if not r["ok"]]
    assert all("429" in r["error"] and "overloaded" in r["error"] for r in failed)
    done = [r for r in run["requests"] if r["ok"]]
    assert all(r["output_tokens"] == 3 and r["chunks"] == 3 for r in done)
    assert run["server"]["token_id_range"] == [1000, 30000]
    assert "TTFT p99 (ms)" in capsys.readouterr().out


def test_goodput_sweep_against_real_sockets(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A rate sweep with lognormal lengths against two small servers (pdserve's place and
    a peer's): each load gets the same lengths and arrivals on both; every run scored."""
    out = tmp_path / "goodput.json"
    with openai_server("ours", vocab=500) as (url, ours), \
            openai_server("theirs", vocab=None) as (peer, theirs):  # fmt: skip
        rc = main(["bench", "serve", "--url", url, "--peer-url", peer, "--label", "pdserve",
                   "--num-prompts", "6", "--request-rate", "40,80", "--burstiness", "0.5",
                   "--length-dist", "lognormal", "--input-len", "16", "--output-len", "4",
                   "--max-output-len", "12", "--goodput", "ttft:5000", "tpot:1000", "--num-warmups", "0",
                   "--json", str(out)])  # fmt: skip
    assert rc == 0
    lengths = [(len(b["prompt"]), b["max_tokens"]) for b in ours]
    assert len(lengths) == 14 and len({o for _, o in lengths[1:]}) > 1  # warm-up + 6, twice
    assert lengths[1:7] == lengths[8:]  # the same lengths at every rate
    assert sorted(lengths) == sorted((len(b["prompt"]), b["max_tokens"]) for b in theirs)
    payload = json.loads(out.read_text())
    assert payload["config"]["request_rate"] == [40.0, 80.0]
    assert payload["config"]["goodput_slos_ms"] == {"ttft": 5000.0, "tpot": 1000.0}
    assert payload["config"]["max_output_len"] == 12 and "loadavg_1m" in payload["config"]
    runs = payload["runs"]
    assert [(r["label"], r["request_rate"]) for r in runs] == [
        ("pdserve r=40", 40.0), ("pdserve r=80", 80.0), ("peer r=40", 40.0), ("peer r=80", 80.0)]  # fmt: skip
    assert all(r["goodput"]["attainment"] == {"ttft": 1.0, "tpot": 1.0, "all": 1.0} for r in runs)
    series = payload["goodput"]["series"]
    assert [(s["mode"], s["goodput_rps"], s["bound"]) for s in series] == [
        ("pdserve", 80.0, "above_highest"), ("peer", 80.0, "above_highest")]  # fmt: skip
    assert series[0]["goodput_rps_per_device"] is None  # --url: the device count is unknown
    printed = capsys.readouterr().out
    assert "SLO attainment (TTFT <= 5000 ms, TPOT <= 1000 ms" in printed
    assert ">= 80.00" in printed
    from benchmarks.plot_serve import main as plot

    plot(str(out), str(tmp_path / "goodput.png"))  # attainment against rate
    assert (tmp_path / "goodput.png").stat().st_size > 0
    from benchmarks.pd_one_gpu import main as summary  # gpu.sh pd-one-gpu's tables

    summary(["--goodput", str(out), "--tier", str(out)])
    printed = capsys.readouterr().out
    assert "disagg/coloc" in printed and re.search(r"pdserve +100% +100%", printed)
    assert "TTFT p99 (ms)" in printed


@pytest.mark.slow
def test_goodput_sweep_compares_deployments(model_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """CI's goodput sweep: disaggregated, colocated and conditional on the tiny model, two
    rates."""
    monkeypatch.setenv("PDSERVE_ENGINE__KV_CACHE_MEMORY_GB", "0.25")
    monkeypatch.setenv("PDSERVE_TORCH_THREADS", "1")
    out = tmp_path / "goodput.json"
    rc = main(["bench", "serve", "--compare", "--model", str(model_dir), "--num-prompts", "4",
               "--request-rate", "2,8", "--input-len", "32", "--output-len", "4",
               "--goodput", "ttft:60000", "tpot:60000", "--num-warmups", "1",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    payload = json.loads(out.read_text())
    runs = payload["runs"]
    assert [(r["mode"], r["request_rate"]) for r in runs] == [
        ("disaggregated", 2.0), ("disaggregated", 8.0), ("colocated", 2.0), ("colocated", 8.0),
        ("conditional", 2.0), ("conditional", 8.0)]  # fmt: skip
    assert all(r["metrics"]["completed"] == 4 for r in runs)
    # each deployment warmed once, before its first load: buckets 16 and 32, bursts of 2, 4
    warm = [r.get("warmup") for r in runs]
    assert [w is not None for w in warm] == [True, False] * 3
    assert all(w["num_requests"] == 2 + 6 and w["num_failed"] == 0 for w in warm[::2])
    # 32-token prompts: every one prefilled by decode in the conditional deployment, none in
    # the disaggregated one; colocated has no such counter
    assert [r["metrics"]["local_prefill_share"] for r in runs] == [0, 0, None, None, 1, 1]
    # targets of a minute: every request is good, at both rates, in every mode
    assert all(r["goodput"]["attainment"]["all"] == 1.0 for r in runs)
    assert [(s["mode"], s["goodput_rps"], s["bound"], s["goodput_rps_per_device"])
            for s in payload["goodput"]["series"]] == [
        ("disaggregated", 8.0, "above_highest", 8.0), ("colocated", 8.0, "above_highest", 8.0),
        ("conditional", 8.0, "above_highest", 8.0)]  # fmt: skip
    assert payload["config"]["git_commit"] and payload["config"]["command"].startswith("pdserve")


@pytest.mark.slow
def test_bench_serve_against_a_deployment(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    with deployment(tmp_path / "dep", model_dir) as dep:
        rc = main(["bench", "serve", "--url", dep.url, "--num-prompts", "4", "--input-len", "32",
                   "--output-len", "4", "--label", "e2e", "--json", str(out)])  # fmt: skip
    assert rc == 0
    payload = json.loads(out.read_text())
    assert payload["config"]["input_len"] == 32 and payload["config"]["label"] == "e2e"
    [run] = payload["runs"]
    metrics = run["metrics"]
    assert (metrics["completed"], metrics["failed"]) == (4, 0)
    assert metrics["total_output_tokens"] == 16 and metrics["cached_prompt_tokens"] == 0
    assert run["server"]["vocab_size"] > 1000  # read from the router's /openapi.json
    records = run["requests"]
    assert all(r["ttft_ms"] > 0 and r["e2e_ms"] >= r["ttft_ms"] for r in records)
    assert all((r["prompt_tokens"], r["output_tokens"]) == (32, 4) for r in records)
    # every TTFT part was measured (common/runtime/ttft.py); they add up to the router's TTFT,
    # which the client's includes
    parts = [metrics[f"mean_ttft_{part}_ms"] for part in PARTS]
    assert all(v is not None and v >= 0 for v in parts), dict(zip(PARTS, parts, strict=True))
    assert all(metrics[f"median_ttft_{part}_ms"] is not None for part in PARTS)
    assert sum(parts) <= metrics["mean_ttft_ms"] + 1.0


def test_multi_turn_conversations_carry_their_history_and_wait_for_answers(
    tmp_path: Path,
) -> None:
    """--multi-turn 3: 2 users of 3 turns, interleaved; each turn's prompt is the previous
    prompt, a stand-in answer of --output-len ids and a new message of --input-len ids,
    and reaches the server only after the previous turn's answer ended."""
    lengths = [(8, 2)] * 6
    prompts, after = conversations(lengths, 3, (1000, 30000), seed=5)
    assert after == [None, None, 0, 1, 2, 3]
    assert [len(p) for p in prompts] == [8, 8, 18, 18, 28, 28]
    assert all(
        prompts[i][: len(prompts[j])] == prompts[j] for i, j in enumerate(after) if j is not None
    )
    assert conversations(lengths, 3, (1000, 30000), seed=5) == (prompts, after)  # seeded
    assert conversations(lengths, 3, (1000, 30000), seed=6)[0] != prompts
    out = tmp_path / "chat.json"
    with openai_server("ours", vocab=500) as (url, bodies):
        rc = main(["bench", "serve", "--url", url, "--num-prompts", "6", "--multi-turn", "3",
                   "--input-len", "8", "--output-len", "2", "--num-warmups", "0", "--json", str(out)])  # fmt: skip
    assert rc == 0
    sent = [b["prompt"] for b in bodies[1:]]  # after the warm-up, in arrival order
    assert sorted(map(len, sent)) == [8, 8, 18, 18, 28, 28]
    for i, prompt in enumerate(sent):  # each later turn came after the turn it extends
        if len(prompt) > 8:
            assert any(prompt[: len(prompt) - 10] == earlier for earlier in sent[:i])
    payload = json.loads(out.read_text())
    assert payload["config"]["multi_turn"] == 3
    assert payload["runs"][0]["metrics"]["prefix_hit_rate"] == 0.0  # this server caches nothing


def test_warmup_plan_reaches_every_length_bucket_and_batch_size() -> None:
    """Powers of two from 16 up to the longest prompt, then it, N each one at a time (one
    token less each time); then N bursts of 2, 4, ... up to the cap at the median length."""
    plan = warmup_plan(2, [40, 100, 20, 70], output_len=128, max_burst=4)
    singles = [phase for phase in plan if len(phase) == 1]
    assert [i for [(i, _)] in singles] == [16, 15, 32, 31, 64, 63, 100, 99]
    assert [len(phase) for phase in plan if len(phase) > 1] == [2, 2, 4, 4]
    assert {req for phase in plan if len(phase) > 1 for req in phase} == {(70, 8)}
    assert all(o == 8 for phase in plan for _, o in phase)  # a few decode steps each
    assert warmup_plan(0, [40], 8, 4) == []  # --num-warmups 0: none
    assert warmup_plan(1, [8], 2, 1) == [[(8, 2)]]  # below the first bucket; no burst of 1
    # multi-turn: each turn carries its history, so the longest prompt is the last turn's
    assert prompt_lengths([(8, 2)] * 6, 3) == [8, 8, 18, 18, 28, 28]


def test_every_server_is_warmed_before_it_is_measured(tmp_path: Path) -> None:
    """The warm-up's requests reach the server (each phase done before the next) before
    any measured one, and the JSON records them: their count, lengths, bursts, times."""
    out = tmp_path / "warm.json"
    with openai_server("ours", vocab=500) as (url, bodies):
        rc = main(["bench", "serve", "--url", url, "--num-prompts", "4", "--input-len", "40",
                   "--output-len", "3", "--max-concurrency", "4", "--num-warmups", "1",
                   "--json", str(out)])  # fmt: skip
    assert rc == 0
    # buckets 16, 32, then 40 (the longest); bursts of 2 and 4; then the load's opening
    # request and its 4 prompts
    assert [len(b["prompt"]) for b in bodies[:3]] == [16, 32, 40]
    assert [len(b["prompt"]) for b in bodies[3:9]] == [40] * 6
    assert all(b["max_tokens"] == 3 for b in bodies[:9])
    assert len(bodies) == 9 + 1 + 4
    measured = {tuple(b["prompt"]) for b in bodies[10:]}
    assert not measured & {tuple(b["prompt"]) for b in bodies[:9]}  # no prefix hits from it
    payload = json.loads(out.read_text())
    assert payload["config"]["num_warmups"] == 1
    [run] = payload["runs"]
    warm = run["warmup"]
    assert (warm["num_requests"], warm["num_failed"], warm["bursts"]) == (9, 0, [1, 2, 4])
    assert warm["prompt_lens"] == [16, 32, 40] and warm["duration_s"] > 0
    assert [r["phase"] for r in warm["requests"]] == [0, 1, 2, 3, 3, 4, 4, 4, 4]
    assert all(r["ok"] and r["e2e_ms"] > 0 and r["output_tokens"] == 3 for r in warm["requests"])
    # measured requests started after the warm-up ended: none of its time is in the load
    assert run["metrics"]["completed"] == 4


def test_num_warmups_refuses_a_negative_count(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "serve", "--url", "http://127.0.0.1:9", "--num-warmups", "-1"])
    assert rc != 0
    assert "--num-warmups must be 0 or more" in capsys.readouterr().err


def test_a_multi_turn_warm_up_reaches_the_last_turns_length_in_bursts_of_the_users(
    tmp_path: Path,
) -> None:
    """Conversations: the longest prompt is a last turn's (its history included), and no
    more requests are in flight than there are users, so no burst is larger."""
    out = tmp_path / "chat.json"
    with openai_server("ours", vocab=500) as (url, bodies):
        rc = main(["bench", "serve", "--url", url, "--num-prompts", "6", "--multi-turn", "3",
                   "--input-len", "8", "--output-len", "2", "--num-warmups", "1",
                   "--json", str(out)])  # fmt: skip
    assert rc == 0
    # buckets 16, then 28 (8 + 2 + 8 + 2 + 8); one burst of 2 (two users) at the median, 18
    assert [len(b["prompt"]) for b in bodies[:4]] == [16, 28, 18, 18]
    warm = json.loads(out.read_text())["runs"][0]["warmup"]
    assert (warm["num_requests"], warm["bursts"]) == (4, [1, 2])


def test_pd_one_gpu_ratios_respect_goodput_bounds() -> None:
    """A run with one rate gives a goodput bound, not a value: its ratio is a bound too."""
    from benchmarks.pd_one_gpu import _interval, _ratio

    assert _ratio(_interval(11.2, "interpolated"), _interval(8.0, "below_lowest")) == "> 1.40"
    assert _ratio(_interval(12.0, "below_lowest"), _interval(12.0, "above_highest")) == "< 1.00"
    assert _ratio(_interval(13.0, None), _interval(10.0, None)) == "1.30"
    assert _ratio(_interval(12.0, "above_highest"), _interval(12.0, "above_highest")) == "?"
    assert _ratio(None, _interval(1.0, None)) == "-"

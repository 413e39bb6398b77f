"""``pdserve bench accuracy``: lm-eval-harness through the OpenAI router, as the
reference deployment was validated.

Two tasks made from a seed (cli/bench/accuracy_tasks.py: arithmetic word problems answered by
generation, and a four-way multiple choice scored by loglikelihood) are run by lm-eval's
``local-completions`` model against a disaggregated deployment and a colocated one, and
by lm-eval's own ``hf`` backend on the same model directory. The report: per mode the
items, correct answers, API errors and the deployment's counters (KV transfers, bytes,
failures, notification failures, expirations, preemptions, service restarts); then how
the modes agree item by item (generated answers equal, chosen option equal, the largest
loglikelihood difference).

``--pcp N`` gives the disaggregated deployment's prefill N context-parallel ranks;
``--random deepseek_v4`` evaluates a random DeepSeek-V4 checkpoint written into the work
directory (common/model/fixtures/random.py ``save_random_v4``: every kind of attention layer,
hash_moe and moe layers, 4 hyper-connection streams) instead of ``--model``.

lm-eval is not a dependency of pdserve: install it (``pip install 'pdserve[accuracy]'``)
or name another interpreter that has it with ``--lm-eval-python``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.cli.bench.arg_types import positive_int
from pdserve.cli.provenance import provenance

MODES = ("disaggregated", "colocated", "hf")
RANDOM_MODELS = ("deepseek_v4",)
# The deployment's counters in the report: (column, metric name, label filter).
COUNTERS = (
    ("kv_transfers", "pdserve:kv_transfers_total", {}),
    ("kv_transfer_bytes", "pdserve:kv_transfer_bytes_total", {}),
    ("kv_transfer_failures", "pdserve:kv_transfer_failures_total", {}),
    ("kv_notification_failures", "pdserve:kv_notification_failures_total", {}),
    ("kv_expired_requests", "pdserve:kv_expired_requests_total", {}),
    # one a request and producer rank: transfers x the prefill's TP x PCP ranks
    ("kv_replica_releases", "pdserve:kv_replica_releases_total", {}),
    ("preemptions", "pdserve:num_preemptions_total", {}),
    ("failed_requests", "pdserve:requests_total", {"finish_reason": "failed"}),
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "accuracy",
        help="lm-eval through the router: disaggregated vs colocated vs lm-eval's hf backend",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: embedded)")
    p.add_argument("--items", type=int, default=100, help="items of each task")
    p.add_argument("--seed", type=int, default=0, help="seed of the task items")
    p.add_argument("--tasks", default="pdserve_arith,pdserve_choice", help="comma-separated")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated of {MODES}")
    p.add_argument("--concurrency", type=int, default=4, help="lm-eval's num_concurrent")
    p.add_argument(
        "--pcp", type=positive_int, default=1, help="prefill PCP ranks of the disaggregated mode"
    )
    p.add_argument(
        "--random",
        choices=RANDOM_MODELS,
        default=None,
        help="evaluate a random checkpoint of this family, written into the work dir",
    )
    p.add_argument(
        "--hf-batch-size", type=positive_int, default=8, help="lm-eval's batch size in hf mode"
    )
    p.add_argument(
        "--lm-eval-python", default=sys.executable, help="an interpreter with lm-eval installed"
    )
    p.add_argument("--work-dir", default=None, help="keep lm-eval's outputs here")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(run=run)


# -- lm-eval ------------------------------------------------------------------------------


def lm_eval(python: str, model: str, model_args: dict[str, Any], tasks: list[str],
            task_dir: Path, out: Path, extra: tuple[str, ...] = ()) -> Path:  # fmt: skip
    """Run lm-eval; returns the folder with its results and samples."""
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    cmd = [python, "-m", "lm_eval", "run", "--model", model, "--model_args", args,
           "--tasks", ",".join(tasks), "--include_path", str(task_dir),
           "--output_path", str(out), "--log_samples", *extra]  # fmt: skip
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"lm-eval exited {code} (log {log}):\n{tail}")
    return out


def read_samples(out: Path, task: str) -> list[dict[str, Any]]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise RuntimeError(f"lm-eval wrote no samples of {task} under {out}")
    rows = [json.loads(line) for line in files[-1].read_text().splitlines() if line]
    return sorted(rows, key=lambda r: r["doc_id"])


def score(rows: list[dict[str, Any]]) -> dict[str, Any]:
    metric = "exact_match" if "exact_match" in rows[0] else "acc"
    correct = sum(int(r[metric]) for r in rows)
    return {"items": len(rows), "correct": correct, "metric": metric,
            "score": correct / len(rows)}  # fmt: skip


# -- deployments --------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Column -> the sum over every sample of its metric (all services, ranks)."""
    totals = {column: 0.0 for column, _, _ in COUNTERS}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        for column, metric, wanted in COUNTERS:
            if name == metric and all(f'{k}="{v}"' in labels for k, v in wanted.items()):
                totals[column] += float(value)
    return totals


def through_router(args: argparse.Namespace, colocated: bool, tasks: list[str],
                   task_dir: Path, out: Path) -> dict[str, Any]:  # fmt: skip
    import msgspec

    from pdserve.cli.deployment import Deployment, local_config
    from pdserve.common.runtime.ports import free_port_block

    base = free_port_block(100)
    # disaggregated: every prompt through the prefill instance (no conditional prefill)
    cfg = local_config(model=args.model, colocated=colocated, base_port=base,
                       http_port=base + 99, local_prefill_threshold=0)  # fmt: skip
    if not colocated:  # the prefill instance's context-parallel ranks
        cfg = msgspec.structs.replace(cfg, pcp=args.pcp)
    dep = Deployment(cfg)
    with dep:
        with urllib.request.urlopen(f"{dep.url}/v1/models", timeout=30) as r:
            served = json.load(r)["data"][0]["id"]
        started = time.monotonic()
        lm_eval(args.lm_eval_python, "local-completions", {
            "model": served, "base_url": f"{dep.url}/v1/completions",
            "tokenizer_backend": "huggingface", "tokenizer": model_dir(args.model),
            "num_concurrent": args.concurrency, "max_retries": 1, "timeout": 600,
        }, tasks, task_dir, out)  # fmt: skip
        seconds = time.monotonic() - started
        with urllib.request.urlopen(f"{dep.url}/metrics", timeout=30) as r:
            counters = parse_metrics(r.read().decode())
        restarts = sum(dep.num_restarts.values())
    return {"seconds": seconds, "counters": counters, "service_restarts": restarts,
            "roles": [name for name, _ in dep.roles()]}  # fmt: skip


def model_dir(model: str | None) -> str:
    from pdserve.common.model.checkpoint.files import resolve_model

    return str(resolve_model(model))


# -- comparison and report -----------------------------------------------------------------


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """Item by item: equal answers (generation) or equal choices and the largest
    loglikelihood difference (multiple choice)."""
    same, max_diff = 0, 0.0
    for x, y in zip(a, b, strict=True):
        if "exact_match" in x:
            same += x["resps"] == y["resps"]
            continue
        lx = [float(r[0][0]) for r in x["resps"]]
        ly = [float(r[0][0]) for r in y["resps"]]
        same += lx.index(max(lx)) == ly.index(max(ly))
        max_diff = max(max_diff, *(abs(p - q) for p, q in zip(lx, ly, strict=True)))
    return {"items": len(a), "same": same, "max_loglikelihood_diff": max_diff}


def format_report(result: dict[str, Any]) -> str:
    lines = ["| mode | task | items | correct | score | API errors | KV transfers | KV bytes "
             "| transfer failures | notification failures | expirations | replica releases "
             "| preemptions | restarts |", "|" + " --- |" * 14]  # fmt: skip
    for mode, run in result["modes"].items():
        c = run.get("counters") or {}
        for task, s in run["scores"].items():
            deployed = "counters" in run
            cells = [mode, task, str(s["items"]), str(s["correct"]), f"{s['score']:.3f}",
                     str(int(c.get("failed_requests", 0))) if deployed else "-"]  # fmt: skip
            for column in ("kv_transfers", "kv_transfer_bytes", "kv_transfer_failures",
                           "kv_notification_failures", "kv_expired_requests",
                           "kv_replica_releases", "preemptions"):  # fmt: skip
                cells.append(str(int(c.get(column, 0))) if deployed else "-")
            cells.append(str(run["service_restarts"]) if deployed else "-")
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| modes | task | items | same answer | max loglikelihood diff |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for pair, tasks in result["agreement"].items():
        for task, a in tasks.items():
            lines.append(f"| {pair} | {task} | {a['items']} | {a['same']} "
                         f"| {a['max_loglikelihood_diff']:.2e} |")  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from pdserve.cli.bench.accuracy_tasks import write_tasks

    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        print(f"error: --modes: unknown {unknown}; choose from {MODES}", file=sys.stderr)
        return 2
    tasks = [t for t in args.tasks.split(",") if t]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pdserve-accuracy-"))
    if args.random:
        from pdserve.common.model.fixtures.random import save_random_v4

        print(f"accuracy: a random {args.random} checkpoint ...", file=sys.stderr, flush=True)
        args.model = str(save_random_v4(work / f"random-{args.random}", tokenizer_from=args.model))
    task_dir = work / "tasks"
    write_tasks(task_dir, args.items, args.seed)
    result: dict[str, Any] = {"benchmark": "accuracy", **provenance(), "model": model_dir(args.model),
                              "items": args.items, "seed": args.seed, "tasks": tasks, "pcp": args.pcp,
                              "random": args.random, "modes": {}}  # fmt: skip
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for mode in modes:
        print(f"accuracy: {mode} ...", file=sys.stderr, flush=True)
        out = work / mode
        if mode == "hf":
            started = time.monotonic()
            lm_eval(args.lm_eval_python, "hf",
                    {"pretrained": model_dir(args.model), "dtype": "float32"},
                    tasks, task_dir, out,
                    ("--device", "cpu", "--batch_size", str(args.hf_batch_size)))  # fmt: skip
            run_info: dict[str, Any] = {"seconds": time.monotonic() - started}
        else:
            run_info = through_router(args, mode == "colocated", tasks, task_dir, out)
        samples[mode] = {task: read_samples(out, task) for task in tasks}
        run_info["scores"] = {task: score(rows) for task, rows in samples[mode].items()}
        result["modes"][mode] = run_info
    result["agreement"] = {
        f"{a} vs {b}": {task: compare(samples[a][task], samples[b][task]) for task in tasks}
        for i, a in enumerate(modes) for b in modes[i + 1:]
    }  # fmt: skip
    print(format_report(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0

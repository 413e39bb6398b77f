"""The accuracy run's two lm-eval tasks, made from a seed: files anyone can regenerate.

- ``pdserve_arith`` (generate_until): arithmetic word problems with a numeric answer,
  three solved examples as the description, greedy, the first number of the answer
  compared exactly.
- ``pdserve_choice`` (multiple_choice, loglikelihood): a sum or a comparison with four
  candidate answers; lm-eval scores each by the log-probability of its tokens, which
  through the API is ``echo`` with ``logprobs``.

``write_tasks(folder, items, seed)`` writes both data files (JSON lines) and the task
YAMLs that point at them; ``lm-eval --include_path folder`` then knows the tasks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivo", "Jun")
THINGS = ("apples", "books", "coins", "pencils", "stamps", "shells", "marbles", "cards")

ARITH_SHOTS = (
    "Q: Ana has 3 apples. She gets 4 more. How many apples does Ana have now?\nA: 7\n\n"
    "Q: Ben has 9 coins. He gives away 2. How many coins does Ben have now?\nA: 7\n\n"
    "Q: Chen has 2 boxes with 5 cards in each. How many cards does Chen have?\nA: 10\n\n"
)


def arith_item(rng: random.Random) -> dict[str, Any]:
    name, things = rng.choice(NAMES), rng.choice(THINGS)
    kind = rng.choice(("add", "sub", "mul"))
    if kind == "add":
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        question = f"{name} has {a} {things}. They get {b} more. How many {things} now?"
        answer = a + b
    elif kind == "sub":
        a = rng.randint(2, 30)
        b = rng.randint(1, a - 1)
        question = f"{name} has {a} {things}. They give away {b}. How many {things} are left?"
        answer = a - b
    else:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        question = f"{name} has {a} bags with {b} {things} in each. How many {things} in all?"
        answer = a * b
    return {"question": question, "answer": str(answer), "kind": kind}


def choice_item(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.5:
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        right = a + b
        question = f"What is {a} plus {b}?"
        wrong = rng.sample([n for n in range(max(0, right - 6), right + 7) if n != right], 3)
        options = [str(n) for n in [right, *wrong]]
    else:
        a, b = rng.sample(range(1, 100), 2)
        question = f"Which number is larger, {a} or {b}?"
        others = rng.sample([n for n in range(1, 100) if n not in (a, b)], 2)
        options = [str(max(a, b)), str(min(a, b)), *(str(n) for n in others)]
    gold_text = options[0]
    rng.shuffle(options)
    return {"question": question, "choices": options, "gold": options.index(gold_text)}


ARITH_YAML = """\
task: pdserve_arith
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
description: {description}
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
filter_list:
  - name: first_number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1
"""

CHOICE_YAML = """\
task: pdserve_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1
"""

TASKS = ("pdserve_arith", "pdserve_choice")


def write_tasks(folder: Path, items: int, seed: int) -> list[str]:
    """``items`` of each task from ``seed`` into ``folder``; returns the task names."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    arith = [arith_item(rng) for _ in range(items)]
    choice = [choice_item(rng) for _ in range(items)]
    for name, rows in (("arith", arith), ("choice", choice)):
        with open(folder / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    (folder / "pdserve_arith.yaml").write_text(
        ARITH_YAML.format(data=folder / "arith.jsonl", description=json.dumps(ARITH_SHOTS))
    )
    (folder / "pdserve_choice.yaml").write_text(CHOICE_YAML.format(data=folder / "choice.jsonl"))
    return list(TASKS)

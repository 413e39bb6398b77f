"""The fault table: run the fault suite (tests/test_faults*.py, real processes, kill -9
and friends) and the hostile-input suite (tests/test_hostile.py, test_hostile_router.py:
forged messages, poison values, huge prompts, greedy clients, a frozen router; issue 19)
and print what they measured for each fault: faults injected, requests affected,
terminal replies, KV blocks leaked, time to detect and its bound.

    python benchmarks/faults.py          # runs both (~6 min on 2 cores), writes
                                         # benchmarks/results/faults.json and
                                         # faults-hostile.json, prints the table
    python benchmarks/faults.py --show   # prints the table of the last run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "faults.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--show", action="store_true", help="print the last run's table, run nothing"
    )
    parser.add_argument(
        "--json", type=Path, default=RESULT, help=f"where the suite writes (default {RESULT})"
    )
    args = parser.parse_args()
    if not args.show:
        env = {**os.environ, "PDSERVE_FAULTS_JSON": str(args.json.resolve())}
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_faults.py",
            "tests/test_faults_prefill_rank.py",
            "tests/test_hostile.py",
            "tests/test_hostile_router.py",
        ]
        code = subprocess.call(cmd, cwd=ROOT, env=env)
        if code != 0:
            return code
    sys.path.insert(0, str(ROOT))
    from tests.fault_tools import FaultReport, FaultRow

    rows = []  # the hostile suite writes beside the fault suite (tests/hostile_tools.py)
    hostile = args.json.with_name(f"{args.json.stem}-hostile{args.json.suffix}")
    for path in (args.json, hostile):
        if path.is_file():
            data = json.loads(path.read_text())
            print(f"{path.name} settings: {data['meta']}")
            rows += [FaultRow(**row) for row in data["rows"]]
    print(FaultReport(rows).table())
    return 0


if __name__ == "__main__":
    sys.exit(main())

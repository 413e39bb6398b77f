"""The built wheel, as a packager or a deployment host gets it: every source under the
packaged folders is in it, and installed outside the checkout it answers ``pdserve
generate`` and serves through a prefill + decode deployment (``pdserve demo``).

The wheel is built from a copy of the files git knows (tracked, or new and not ignored),
with the venv's setuptools and without dependencies (nothing downloaded, torch untouched),
then installed with ``--no-deps --target`` into a folder that comes first on PYTHONPATH:
the commands run from a folder outside the checkout, so ``pdserve`` resolves to the
installed copy and not to the editable one (the venv's editable finder comes after the
path). The compiled CPU kernels' build from the installed folder is not redone here (its
sources' hash names a build the checkout already made; a fresh one takes ~1-2 minutes on
2 cores): the installed copy's sources are checked to be where kernels/cpu_native.py reads
them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pdserve.common.runtime.ports import free_port_block

pytestmark = pytest.mark.slow  # pip and real processes

ROOT = Path(__file__).resolve().parent.parent
PACKAGED = ("pdserve", "cli", "common", "kernels", "services")  # pdserve/: the package itself
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md")


def _known_files(*paths: str) -> list[str]:
    """The files git knows under ``paths`` (tracked, or new and not ignored) that exist."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted({f for f in out.splitlines() if (ROOT / f).is_file()})


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    src = tmp_path_factory.mktemp("src")
    for name in _known_files(*PACKAGED, *BUILD_INPUTS):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
        check=True,
    )  # fmt: skip
    [built] = out.glob("pdserve-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
         "--disable-pip-version-check", "-q", "--target", str(site), str(wheel)],
        check=True,
    )  # fmt: skip
    return site


def _run(site: Path, cwd: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` with the installed copy first on the path, from outside the checkout."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_every_source_is_in_the_wheel(wheel: Path) -> None:
    """A .py, .cpp or other file under the packaged folders that the wheel lacks: a
    sub-package or a kind of data file the build does not pick up (setup.py, pyproject's
    package-data)."""
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
    want = {
        name if name.startswith("pdserve/") else f"pdserve/{name}"
        for name in _known_files(*PACKAGED)
    }
    missing = sorted(want - names)
    assert not missing, f"{len(missing)} source files missing from the wheel: {missing[:20]}"


def test_the_installed_copy_generates_and_serves(
    installed: Path, model_dir: Path, tmp_path: Path
) -> None:
    where = _run(
        installed,
        tmp_path,
        "-c",
        "import pdserve, pdserve.common.engine.config, pdserve.kernels.cpu_native as k; "
        "print(pdserve.__file__); print(*pdserve.__path__); print(*k.SOURCES)",
        timeout=120,
    )
    assert where.returncode == 0, where.stderr
    init, path, *sources = where.stdout.split()
    assert init == str(installed / "pdserve" / "__init__.py") and path == str(installed / "pdserve")
    assert sources and all(Path(s).is_file() and Path(s).is_relative_to(installed) for s in sources)

    generate = _run(
        installed, tmp_path, "-m", "pdserve", "generate", "--model", str(model_dir),
        "--prompt", "Hello", "--max-tokens", "4", timeout=300,
    )  # fmt: skip
    assert generate.returncode == 0 and generate.stdout.strip(), generate.stderr

    base = free_port_block(100)
    demo = _run(
        installed, tmp_path, "-m", "pdserve", "demo", "--model", str(model_dir),
        "--max-tokens", "2", "--zmq-port", str(base), "--http-port", str(base + 99),
        "--log-dir", str(tmp_path / "logs"), timeout=300,
    )  # fmt: skip
    logs = {p.name: p.read_text()[-2000:] for p in (tmp_path / "logs").glob("*.log")}
    assert demo.returncode == 0, (demo.stderr, logs)
    assert "starting prefill-0, decode-0, router" in demo.stderr, demo.stderr
    assert demo.stdout.count("> ") == 4, demo.stdout  # 3 chat answers over HTTP, 1 over ZMQ

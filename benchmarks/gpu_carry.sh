#!/usr/bin/env bash
# Prepare what a device run of benchmarks/gpu.sh carries (run here, in the repo's root):
#
#   bash benchmarks/gpu_carry.sh [COMMIT]     (default HEAD)
#
# - .whl/ (kept between calls): wheels the GPU machine lacks (Python 3.12 there): nixl with
#   nixl-cu13 stripped of its nixl_ep_cu13 libraries (3 x 31 MB for torch versions we never
#   load: without them the wheels fit the 64 MiB a call carries), pyzmq, msgspec, structlog, setproctitle, and the openai SDK
#   with its dependencies (test_gpu_serving's OpenAI-client tests).
# - .gpu/src/: `git archive COMMIT` with those wheels in its .whl/, the embedded model's
#   tokenizer (gzipped: gpu.sh unpacks it) in its .gpu/tok/ and the commit in .gpu/commit: a
#   run tests that commit, not whatever the work tree holds at the moment of the call.
# Then: run(command="cd .gpu/src && bash benchmarks/gpu.sh gpu-tests", carry=[".gpu"]).
# .whl/ (the wheel cache) and .gpu/ are in .git/info/exclude: only what `carry` names travels.
set -euo pipefail
cd "$(dirname "$0")/.."
commit=$(git rev-parse "${1:-HEAD}")
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude

if [ ! -f .whl/.done ]; then
    rm -rf .whl && mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        nixl==1.5.1 nixl-cu13==1.5.1 pyzmq msgspec structlog setproctitle \
        openai httpx2 httpcore2 h11 anyio sniffio distro jiter pydantic pydantic-core idna \
        typing-inspection annotated-types typing-extensions truststore certifi 2>&1 | grep -v '^WARNING' || true
    # drop nixl_ep_cu13 (the expert-parallel extension, never imported here) from the wheel
    python3 - .whl/nixl_cu13-*.whl <<'PY'
import os, sys, zipfile
src = sys.argv[1]
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(src + ".tmp", "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if not item.filename.startswith("nixl_ep_cu13/"):
            zout.writestr(item, zin.read(item.filename))
os.replace(src + ".tmp", src)
PY
    touch .whl/.done
fi

rm -rf .gpu && mkdir -p .gpu/src
git archive "$commit" | tar -x -C .gpu/src
cd .gpu/src
mkdir -p .gpu/tok .whl
ln ../../.whl/*.whl .whl/ 2>/dev/null || cp ../../.whl/*.whl .whl/
echo "$commit" > .gpu/commit
../../.venv/bin/python - <<'PY'
import gzip, shutil
from pdserve.common.model.checkpoint.files import resolve_model
src = resolve_model(None)  # the embedded model's converted directory: its tokenizer files
with open(src / "tokenizer.json", "rb") as f, gzip.open(".gpu/tok/tokenizer.json.gz", "wb", 9) as g:
    shutil.copyfileobj(f, g)
shutil.copy(src / "tokenizer_config.json", ".gpu/tok/tokenizer_config.json")
PY
cd ../..
du -sh .gpu

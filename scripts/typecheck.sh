#!/usr/bin/env bash
# mypy over pdserve.common and pdserve.services (config: [tool.mypy] in pyproject.toml).
#
# The sources live at the repository root (common/, services/, ...) and import each other as
# pdserve.*; an editable install maps the names with an import hook, which mypy cannot see
# (`mypy common services` would type every pdserve import as Any). So mypy reads the tree
# through build/mypy/pdserve/, a view of symbolic links with the installed names.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
view=build/mypy/pdserve
mkdir -p "$view"
cp pdserve/__init__.py "$view/__init__.py"
for pkg in common services kernels cli; do
    ln -sfn "$root/$pkg" "$view/$pkg"
done
python=$root/${PDSERVE_VENV:-.venv}/bin/python
cd build/mypy
exec "$python" -m mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" \
    -p pdserve.common -p pdserve.services "$@"

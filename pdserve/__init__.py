"""pdserve: prefill/decode disaggregated LLM serving.

The subpackages live at the repository root (``common/``, ``kernels/``, ``services/``,
``cli/``); an install maps them under ``pdserve``. When this file is imported from a
source checkout (the repository root on ``sys.path``, as with ``python -m`` run there),
the root joins the package path so ``pdserve.common`` resolves to the same files.
"""

import os as _os

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(
    _os.path.join(_root, "common")
):
    __path__.append(_root)

"""The package list, found when the wheel is built (the rest of the metadata: pyproject.toml).

The sources live at the repository root (``cli/``, ``common/``, ``kernels/``,
``services/``) and install as ``pdserve.cli``, ``pdserve.common``, ...; pyproject.toml's
package finder cannot put a prefix on the names it finds, so this file does. Every folder
under the four roots is a package (a namespace find: a folder without ``__init__.py`` is
shipped too), so a new sub-package cannot be left out of the wheel; tests/test_wheel.py
checks the built wheel against ``git ls-files``.
"""

from setuptools import find_namespace_packages, setup

ROOTS = ("cli", "common", "kernels", "services")

packages = ["pdserve"]
for root in ROOTS:
    packages.append(f"pdserve.{root}")
    found = find_namespace_packages(where=root, exclude=["__pycache__", "*.__pycache__"])
    packages += [f"pdserve.{root}.{name}" for name in found]

setup(
    packages=packages,
    # a sub-package's folder is found under its root's (pdserve.common.engine: common/engine)
    package_dir={"pdserve": "pdserve", **{f"pdserve.{root}": root for root in ROOTS}},
)

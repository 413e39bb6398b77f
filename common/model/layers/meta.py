"""Building a model's modules without values (meta tensors), for the loader to assign its
weights to."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def meta_modules() -> Iterator[None]:
    """Modules built here are meta tensors, with no values to initialise: ``torch.nn.init``
    is a no-op inside. (On meta tensors its functions also import torch._dynamo, ~0.8 s of
    each process's start.)"""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    for n in names:
        setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        with torch.device("meta"):
            yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)

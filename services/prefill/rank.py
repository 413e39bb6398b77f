"""A prefill rank is the generic rank process (services/ranks/process.py) with a KVProducer agent."""

from __future__ import annotations

from pdserve.services.ranks.process import DROP_RELEASES_ENV

__all__ = ["DROP_RELEASES_ENV"]

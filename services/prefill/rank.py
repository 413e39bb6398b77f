"""A prefill rank is the generic rank process (common/rank.py) with a KVProducer agent."""

from __future__ import annotations

from pdserve.common.rank import DROP_RELEASES_ENV

__all__ = ["DROP_RELEASES_ENV"]

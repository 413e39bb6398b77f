"""Fault injection for tests, read once from the environment when a process starts (never
on the hot path). Unset, every hook is off."""

from __future__ import annotations

import os

import msgspec

# While the file this names exists, decode starts no pull (the requests wait, their leases
# kept by heartbeats), so a test can kill a peer in between.
HOLD_PULLS_ENV = "PDSERVE_TEST_HOLD_PULLS_FILE"
# A prefill rank (its global rank) that silently drops every release its agent receives.
DROP_RELEASES_ENV = "PDSERVE_TEST_DROP_RELEASES_RANK"


class FaultHooks(msgspec.Struct, frozen=True, kw_only=True):
    hold_pulls_file: str | None = None
    drop_releases_rank: int | None = None

    @classmethod
    def from_env(cls) -> FaultHooks:
        drop = os.environ.get(DROP_RELEASES_ENV)
        return cls(
            hold_pulls_file=os.environ.get(HOLD_PULLS_ENV) or None,
            drop_releases_rank=int(drop) if drop else None,
        )

    def pulls_held(self) -> bool:
        return self.hold_pulls_file is not None and os.path.exists(self.hold_pulls_file)

"""The parts of the deployment configuration ([[prefill]], [[decode]], [security]) that
name where a service is reached and how its sockets are secured (service_config.py's
``DeploymentConfig`` holds them)."""

from __future__ import annotations

from urllib.parse import urlsplit

import msgspec

WILDCARD_HOSTS = ("0.0.0.0", "::", "*")


class InstanceAddresses(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where peers reach one service; it binds the same ports on ``bind_host`` if set."""

    address: str  # the service's ROUTER socket, for the router
    side_channel: str = ""  # prefill only: handshakes, heartbeats and releases from decode
    # Where the service binds its ports ("0.0.0.0": every interface); empty: the host of
    # its addresses. The addresses above stay what it advertises: the router connects to
    # ``address`` and decode to the ``side_channel`` a KV handle names, so they must be
    # ones peers reach, never a wildcard.
    bind_host: str = ""

    def __post_init__(self) -> None:
        for name in ("address", "side_channel"):
            value = getattr(self, name)
            if value and urlsplit(value).hostname in WILDCARD_HOSTS:
                # ValueError: msgspec adds where in the file (`$.decode[1]`)
                raise ValueError(
                    f"{name} {value} is a wildcard, which peers cannot connect to: give the "
                    'address they reach this service at, and bind_host = "0.0.0.0" to bind '
                    "every interface"
                )

    def bound(self, address: str) -> str:
        """``address`` as this service binds it: its host replaced by ``bind_host``."""
        if not self.bind_host:
            return address
        parts = urlsplit(address)
        host = f"[{self.bind_host}]" if ":" in self.bind_host else self.bind_host
        return f"{parts.scheme}://{host}:{parts.port}"


class SecurityConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[security]``: wire security of every ZeroMQ socket (docs/operations.md)."""

    # A directory made by `pdserve keys --dir DIR`: every ZMQ socket then uses CURVE
    # (encrypted; only clients whose public key is in DIR/authorized_keys get in).
    # Empty: off. A relative path is taken from the working directory of each process.
    curve_keys_dir: str = ""
    # Keys for the internal sockets only (services' ROUTERs, side channels; the front
    # door stays as configured above): `pdserve up` makes a pair in a private runtime
    # directory and names it here when nothing else is configured.
    internal_keys_dir: str = ""
    # No CURVE on the internal sockets even where `pdserve up` would make keys: any
    # process that reaches a service's port may then talk to it (logged at start).
    insecure: bool = False

    @property
    def internal_keys(self) -> str:
        """The key directory of the internal sockets ("" when they run without CURVE)."""
        return self.curve_keys_dir or self.internal_keys_dir

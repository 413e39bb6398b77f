"""CURVE on the wire: `pdserve keys` makes usable keys; a deployment with
``[security] curve_keys_dir`` serves authenticated SDK clients and refuses the others
(counted, logged, and reported to the client at once instead of hanging)."""

from __future__ import annotations

import asyncio
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from pdserve.cli.deployment import Deployment
from pdserve.cli.main import main
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.curve import SERVER, CurveKeys, HandshakeLog, WireSecurity, create_keys
from pdserve.common.runtime.ports import free_port
from pdserve.common.runtime.sockets import make_socket
from pdserve.services.router.client import AsyncClient, Client, GenerationFailed
from tests.e2e import deployment
from tests.test_serving import metrics, total

SAFETY_TIMEOUT = 60.0  # never reached when refusals are reported; bounds a broken test


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("keys")
    assert main(["keys", "--dir", str(directory), "--client", "alice"]) == 0
    return directory


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Keys of another deployment: a valid pair nobody here authorized."""
    directory = tmp_path_factory.mktemp("stranger")
    create_keys(directory)
    return directory


def test_keys_command_makes_usable_keys(keys: Path) -> None:
    names = {p.name for p in keys.iterdir()}
    assert names >= {"server.key", "server.key_secret", "client.key", "client.key_secret",
                     "alice.key", "alice.key_secret", "authorized_keys"}  # fmt: skip
    assert {p.name for p in (keys / "authorized_keys").iterdir()} == {"alice.key"}
    assert stat.S_IMODE((keys / "alice.key_secret").stat().st_mode) == 0o600
    before = (keys / "server.key_secret").read_bytes()
    assert main(["keys", "--dir", str(keys)]) == 0  # a second run keeps what exists
    assert (keys / "server.key_secret").read_bytes() == before
    assert main(["keys", "--dir", str(keys), "--client", "../evil"]) == 2
    security = WireSecurity.from_dir(str(keys))
    assert (
        security.server is not None and security.front is not None and security.client is not None
    )
    assert CurveKeys.client(keys, "alice").server_key == security.server.public_key


def test_curve_sockets_let_in_only_authorized_keys(keys: Path, stranger: Path) -> None:
    """In process, through make_socket: who gets an answer from the front door and from an
    internal socket, and what is counted."""
    refused: list[int] = []
    front, internal = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    own, alice, foreign = (
        CurveKeys.client(keys),
        CurveKeys.client(keys, "alice"),
        CurveKeys.client(stranger),
    )
    unauthorized = CurveKeys(public_key=foreign.public_key, secret_key=foreign.secret_key,
                             server_key=alice.server_key)  # fmt: skip
    cases = [  # (address, client keys, answered)
        (front, own, True), (front, alice, True), (internal, own, True), (internal, alice, False),
        (front, unauthorized, False), (front, None, False), (front, foreign, False),
    ]  # fmt: skip

    async def run() -> list[bool]:
        ctx = zmq.asyncio.Context()
        servers = [
            make_socket(ctx, zmq.ROUTER, bind=front, curve=CurveKeys.server(keys, lambda: refused.append(1), front=True)),
            make_socket(ctx, zmq.ROUTER, bind=internal, curve=CurveKeys.server(keys, lambda: refused.append(1))),
        ]  # fmt: skip

        async def echo(server: zmq.asyncio.Socket) -> None:
            while True:
                identity, payload = await server.recv_multipart()
                await server.send_multipart([identity, payload])

        tasks = [asyncio.create_task(echo(server)) for server in servers]
        answered = []
        for address, curve, expected in cases:
            sock = make_socket(ctx, zmq.DEALER, connect=address, curve=curve)
            await sock.send(b"ping")
            # The answer comes at once or never: wait long only for the ones expected.
            answered.append(bool(await sock.poll(10_000 if expected else 300)))
            sock.close()
        for task in tasks:
            task.cancel()
        ctx.destroy(linger=0)
        return answered

    assert asyncio.run(run()) == [expected for _, _, expected in cases]
    assert len(refused) >= 4  # one per refused peer at least (a wrong server key retries: more)


def test_handshake_log_counts_a_servers_refusals_and_ignores_other_events(keys: Path) -> None:
    refused: list[int] = []
    server = HandshakeLog("tcp://x:1", CurveKeys.server(keys, lambda: refused.append(1)))
    client = HandshakeLog("tcp://x:1", CurveKeys.client(keys))
    for event in (
        zmq.EVENT_DISCONNECTED,
        zmq.EVENT_HANDSHAKE_SUCCEEDED,
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    ):
        server(event)
        client(event)  # logged, not counted: the refusal is the server's to count
    assert refused == [1]
    assert (
        client.events & zmq.EVENT_HANDSHAKE_FAILED_AUTH
        and not server.events & zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )


def test_authorized_keys_are_reread_without_a_restart(tmp_path: Path) -> None:
    create_keys(tmp_path, ("bob",))
    address = f"tcp://127.0.0.1:{free_port()}"
    bob = CurveKeys.client(tmp_path, "bob")
    granted = tmp_path / "authorized_keys" / "bob.key"

    async def run() -> list[bool]:
        ctx = zmq.asyncio.Context()
        server = make_socket(
            ctx, zmq.ROUTER, bind=address, curve=CurveKeys.server(tmp_path, front=True)
        )

        async def echo() -> None:
            while True:
                await server.send_multipart(await server.recv_multipart())

        task = asyncio.create_task(echo())
        answered = []
        for expected in (True, False, True):  # granted, revoked, granted again
            if expected:
                granted.write_bytes((tmp_path / "bob.key").read_bytes())
            else:
                granted.unlink()
            sock = make_socket(ctx, zmq.DEALER, connect=address, curve=bob)
            await sock.send(b"ping")
            answered.append(bool(await sock.poll(10_000 if expected else 300)))
            sock.close()
        task.cancel()
        ctx.destroy(linger=0)
        return answered

    assert asyncio.run(run()) == [True, False, True]


@pytest.fixture(scope="module")
def dep(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, keys: Path
) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("dep")
    with deployment(
        tmp, model_dir, engine={"max_model_len": 256}, security={"curve_keys_dir": str(keys)}
    ) as d:
        yield d


@pytest.mark.slow
def test_authenticated_sdk_clients_are_served(dep: Deployment, keys: Path) -> None:
    # Router -> prefill -> decode, the decode -> prefill side channel: all over CURVE.
    with Client(
        dep.cfg.front_address, curve=CurveKeys.client(keys, "alice"), timeout=SAFETY_TIMEOUT
    ) as c:
        result = c.generate(prompt="The capital of France is", max_tokens=4, temperature=0.0)
    assert len(result.token_ids) == 4 and result.finish_reason == "length"

    async def streamed() -> list[int]:
        async with AsyncClient(
            dep.cfg.front_address, curve=CurveKeys.client(keys), timeout=SAFETY_TIMEOUT
        ) as ac:
            return [
                t
                async for chunk in ac.stream(prompt="The capital of France is", max_tokens=4)
                for t in chunk.token_ids
            ]

    assert asyncio.run(streamed()) == result.token_ids


@pytest.mark.slow
def test_unauthenticated_clients_are_refused_and_told(
    dep: Deployment, keys: Path, stranger: Path
) -> None:
    before = total(metrics(dep.url), "pdserve:auth_failures_total", "router")
    foreign = CurveKeys.client(stranger)
    unauthorized = CurveKeys(public_key=foreign.public_key, secret_key=foreign.secret_key,
                             server_key=CurveKeys.client(keys).server_key)  # fmt: skip
    for curve in (None, unauthorized, foreign):
        with Client(dep.cfg.front_address, curve=curve, timeout=SAFETY_TIMEOUT) as c:
            with pytest.raises(GenerationFailed) as failed:
                c.generate(prompt="hello", max_tokens=2)
            assert (
                failed.value.reason == "unauthenticated"
                and dep.cfg.front_address in failed.value.message
            )
            with pytest.raises(
                GenerationFailed, match="refused the connection"
            ):  # later ones at once
                c.generate(prompt="hello", max_tokens=2)

    async def refused_async() -> str:
        async with AsyncClient(dep.cfg.front_address, timeout=SAFETY_TIMEOUT) as ac:
            with pytest.raises(GenerationFailed) as failed:
                await ac.generate(prompt="hello", max_tokens=2)
            return failed.value.reason

    assert asyncio.run(refused_async()) == "unauthenticated"
    # The services' own sockets refuse strangers, and SDK users too (the front door is
    # theirs, not the services); the deployment keeps serving.
    ctx = zmq.Context()
    targets = [a.address for a in dep.cfg.prefill_addresses + dep.cfg.decode_addresses]
    targets += [a.side_channel for a in dep.cfg.prefill_addresses]
    for address in targets:
        for curve in (unauthorized, CurveKeys.client(keys, "alice")):
            sock = make_socket(ctx, zmq.DEALER, connect=address, curve=curve)
            sock.send(p.encode(p.Ping(sent_at=0.0)))
            assert not sock.poll(500), f"{address} answered {curve.public_key!r}"
            sock.close()
    ctx.term()
    with Client(
        dep.cfg.front_address, curve=CurveKeys.client(keys, "alice"), timeout=SAFETY_TIMEOUT
    ) as c:
        assert c.generate(prompt="hello", max_tokens=2).token_ids
    snap = metrics(dep.url)
    assert total(snap, "pdserve:auth_failures_total", "router") >= before + 4
    for service in ("prefill", "decode"):
        assert total(snap, "pdserve:auth_failures_total", service) >= 2
    assert "curve_refused" in (dep.log_dir / "router.log").read_text()


def test_every_zmq_socket_comes_from_the_factory_with_curve() -> None:
    """A socket made anywhere else, or without ``curve=``, would be a hole in the wire."""
    root = Path(__file__).parents[1]
    for path in sorted(f for d in ("common", "services", "cli") for f in (root / d).rglob("*.py")):
        if path.name in ("sockets.py", "curve.py"):
            continue
        text = path.read_text()
        assert not re.search(r"\.socket\(zmq\.|ctx\.socket\(", text), f"{path}: use make_socket"
        # One monitor per socket: asked for through make_socket(monitor_events=), which
        # adds the CURVE handshake events (a second request would get the first's).
        assert not re.search(r"get_monitor_socket\([^)]", text), (
            f"{path}: make_socket(monitor_events=)"
        )
        for start in (m.end() for m in re.finditer(r"\bmake_socket\(", text)):
            depth, end = 1, start
            while depth:
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            assert "curve=" in text[start:end], (
                f"{path}: make_socket({text[start:end]} has no curve="
            )


def test_wrong_keys_dir_is_one_clear_error(tmp_path: Path) -> None:
    assert main(["keys", "--dir", str(tmp_path / "k")]) == 0
    (tmp_path / "k" / f"{SERVER}.key_secret").unlink()
    with pytest.raises(Exception, match="CURVE key .*server.key_secret does not exist"):
        WireSecurity.from_dir(str(tmp_path / "k"))

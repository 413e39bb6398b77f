"""Deployment configuration shared by router, prefill and decode.

Sources, later ones winning: a TOML file < ``PDSERVE_*`` environment variables < flags.
Nested keys in the environment use a double underscore:
``PDSERVE_ENGINE__MAX_NUM_SEQS=32`` sets ``[engine] max_num_seqs``.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from pdserve.common.engine.config import EngineConfig
from pdserve.common.errors import PdserveError
from pdserve.common.runtime.instance_config import (
    WILDCARD_HOSTS,
    InstanceAddresses,
    SecurityConfig,
)

ENV_PREFIX = "PDSERVE_"
# services/router/reasoning.py's parsers, under the names vLLM's --reasoning-parser takes
# (deepseek_v31: older vLLM's; test_reasoning keeps the two lists the same)
REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1", "deepseek_v3", "deepseek_v31",
                     "deepseek_v4", "deepseek_v41")  # fmt: skip
POLICIES = ("fail", "recompute")
# On CPU (embedded model) a prompt prefilled on its decode instance got its first token
# sooner than through a prefill instance at most lengths measured, 32 to 1,024 tokens; from
# 512 on, local prefills raised the TPOT of the streams decoding there (1.3-1.6x), so
# prompts under 512 (benchmarks/README.md, "Conditional disaggregation").
LOCAL_PREFILL_THRESHOLD = 512


class DeploymentConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    device: str = "cpu"
    host: str = "127.0.0.1"  # where services bind when their addresses are derived
    base_port: int = 5600
    http_port: int = 8000
    http_host: str = ""  # where the HTTP API binds (`pdserve up --host`); empty: ``host``
    # The model ids the HTTP API answers to (vLLM's --served-model-name); the first is the
    # one answers carry when a request names none. Empty: the model directory's name.
    served_model_name: str | list[str] = []
    # When set, the HTTP API wants `Authorization: Bearer <api_key>` on every route but
    # /health and /metrics. PDSERVE_API_KEY sets it without putting it on a command line.
    api_key: str = ""
    # More keys the HTTP API takes, one per user or team: with more than one key in all,
    # fair admission tells HTTP clients apart by key (else by peer address, which every
    # user behind one proxy shares).
    api_keys: list[str] = []
    allowed_origins: list[str] = []  # browser origins CORS lets in ("*": any); empty: off
    # how chat answers' tool calls are read (services/router/tool_calls.py): llama3_json,
    # hermes, or auto (from the chat template)
    tool_call_parser: str = "auto"
    # how chat answers' thinking is split from the answer (services/router/reasoning.py):
    # qwen3, deepseek_r1, none, or auto (from the chat template)
    reasoning_parser: str = "auto"
    router_address: str = ""  # the ZMQ SDK's front door; derived when empty
    prefill_instances: int = 1
    decode_instances: int = 1
    prefill: list[InstanceAddresses] = []  # explicit addresses (multi-machine); else derived
    decode: list[InstanceAddresses] = []
    colocated: bool = False  # no prefill service: decode computes prompts (the baseline)
    # Conditional disaggregation (services/router/local_prefill.py): a prompt whose part
    # uncached at its decode instance is shorter than this many tokens, or one every
    # prefill instance is further behind on than that decode, is prefilled by the decode
    # instance itself. 0: every prompt goes to a prefill instance. The default is the
    # CPU measurement of benchmarks/README.md ("Conditional disaggregation").
    local_prefill_threshold: int = LOCAL_PREFILL_THRESHOLD
    pcp: int = 1  # prefill context-parallel ranks per prefill instance
    prefill_tp: int = 1  # tensor-parallel ranks per PCP rank: an instance has tp x pcp ranks
    decode_tp: int | list[int] = 1  # per decode instance: one size for all, or one each
    pull_from: str = "first"  # decode reads replica 0 ("first") or stripes across replicas
    kv_load_failure_policy: str = "fail"
    # what moves KV from prefill to decode: a name of common/transfer/registry.py ("nixl";
    # "inprocess": both engines in one process, tests)
    kv_transfer_backend: str = "nixl"
    # UCX settings of every prefill and decode process (NIXL's transports), e.g.
    # {UCX_TLS = "tcp"} between hosts without RDMA; a variable set in a process's own
    # environment (the unit's env file) wins. docs/operations.md, "KV transport".
    ucx: dict[str, str] = {}
    lease_seconds: float = 30.0  # KV of a prefilled request stays pinned this long at most...
    heartbeat_seconds: float = 5.0  # ...unless decode, still wanting it, heartbeats this often
    # Liveness (docs/operations.md, "Faults"): the router pings every service each
    # ping_seconds; a peer silent for peer_timeout_seconds is down (at the router: its
    # requests fail; at a service: the lost router's requests are aborted). A connection
    # that drops marks the peer down at once.
    ping_seconds: float = 1.0
    peer_timeout_seconds: float = 5.0
    max_queued_requests: int = 1024  # per service; beyond it requests fail "overloaded"
    # The router's deadline for each phase of a request (0: none): the prefill's answer,
    # the first token once decode has the request, the gap between two tokens. Past one
    # the request fails "timeout" naming the phase and the instance, which is told to abort.
    # Router admission (one client must not starve the others): requests in flight per
    # client (an SDK connection, an HTTP peer address), prompts per HTTP request, bytes
    # per HTTP body (read no further).
    max_requests_per_client: int = 256
    max_prompts_per_request: int = 128
    max_body_bytes: int = 32 * 2**20
    # Requests the router has at its prefill and decode instances at once (0: derived,
    # `dispatch_window`); the others wait at the router, clients served in turn, so one
    # client's backlog queues behind its own requests, not in front of another's.
    max_dispatched_requests: int = 0
    # Per-client limits (fair admission, services/router/fair_queue.py): dispatch slots one
    # client may hold at once (0: derived, ``dispatch_share``) and requests one client may
    # have waiting for a slot (0: only max_requests_per_client bounds them); past the
    # second, its next request is refused "overloaded" (HTTP 429).
    max_dispatched_per_client: int = 0
    max_queued_per_client: int = 0
    # Whether an OpenAI body's ``user`` names the client for fair admission and the
    # engines' waiting lines (per API key when there are several). Off: anyone could claim
    # to be many users and take more than one share; ``user`` is then ignored.
    trust_user_field: bool = False
    # Per-client metrics (pdserve:client_*): the first this many clients seen get a
    # label of their own, every later one "other" (bounded cardinality).
    max_client_classes: int = 8
    # An HTTP body not read whole within this many seconds: 408, connection closed.
    body_read_timeout_seconds: float = 30.0
    # The HTTP front door's connections (services/router/http_front.py): a request's
    # headers not received within http_header_timeout_seconds of the connection's start:
    # 408, closed; a connection idle this long after its last answer: closed; open
    # connections per client address and in all (0: the fd limit, RLIMIT_NOFILE, less
    # 1024): past either, 503 with Retry-After, closed.
    http_header_timeout_seconds: float = 15.0
    http_keepalive_timeout_seconds: float = 30.0
    max_http_connections: int = 0
    max_http_connections_per_client: int = 1024
    # false: a special token's text inside a chat message's content (<|im_start|>system)
    # is tokenised as plain text, not as the control token (true: vLLM's and HF's way).
    special_tokens_in_content: bool = True
    # A long prompt not tokenised within this many seconds (its wait for the router's
    # tokenizer process included): Failed "timeout" (HTTP 504).
    tokenize_timeout_seconds: float = 30.0
    # A structured-output request waits (out of the engine's batch) this long at most for
    # its grammar's compile, on a worker thread of its prefill or decode instance; past
    # it the request fails bad_request (HTTP 400) naming this setting.
    grammar_compile_timeout_seconds: float = 10.0
    prefill_timeout_seconds: float = 300.0
    first_token_timeout_seconds: float = 300.0
    token_gap_timeout_seconds: float = 60.0
    drain_seconds: float = 30.0  # on SIGTERM: how long work in flight may take to finish
    # `pdserve up` starts a service that exited with a failure again after restart_seconds,
    # doubling with each failed life in a row up to restart_max_seconds, forever (the
    # systemd units: RestartSec=, RestartMaxDelaySec=); cli/supervisor.py.
    restart_seconds: float = 1.0
    restart_max_seconds: float = 30.0
    # Set by `pdserve up`: the launcher's report of the services it restarts, which the
    # router shows in /health and /metrics (common/runtime/supervision.py). Empty: none.
    supervisor_file: str = ""
    security: SecurityConfig = SecurityConfig()
    engine: EngineConfig = EngineConfig()
    prefill_engine: dict[str, Any] = {}  # overrides of [engine] for prefill only
    decode_engine: dict[str, Any] = {}  # and for decode only
    torch_threads: int = 0  # 0: divide the machine's cores among the local services
    # Per role, to split one machine's cores on purpose (0: torch_threads); e.g. on 2 cores
    # disaggregated, prefill 1 + decode 1 is what the default division gives.
    prefill_torch_threads: int = 0
    decode_torch_threads: int = 0
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        for name in ("torch_threads", "prefill_torch_threads", "decode_torch_threads"):
            if getattr(self, name) < 0:
                raise PdserveError(
                    f"{name} must be 0 (automatic) or more, got {getattr(self, name)}"
                )
        if self.kv_load_failure_policy not in POLICIES:
            raise PdserveError(
                f"kv_load_failure_policy must be one of {', '.join(POLICIES)}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        if self.local_prefill_threshold < 0:
            raise PdserveError(
                f"local_prefill_threshold must be 0 (off) or more tokens, got "
                f"{self.local_prefill_threshold}"
            )
        if bad := [key for key in self.ucx if not key.startswith("UCX_")]:
            raise PdserveError(f"[ucx] holds UCX_* variables only, got {', '.join(bad)}")
        if self.pull_from not in ("first", "striped"):
            raise PdserveError(f"pull_from must be 'first' or 'striped', got {self.pull_from!r}")
        for name in ("prefill_instances", "decode_instances", "pcp", "prefill_tp"):
            if getattr(self, name) < 1:
                raise PdserveError(f"{name} must be at least 1, got {getattr(self, name)}")
        sizes = self.decode_tp if isinstance(self.decode_tp, list) else [self.decode_tp]
        if any(t < 1 for t in sizes):
            raise PdserveError(f"decode_tp must be at least 1, got {self.decode_tp}")
        if isinstance(self.decode_tp, list) and len(self.decode_tp) != self.decode_instances:
            raise PdserveError(
                f"decode_tp lists {len(self.decode_tp)} sizes for {self.decode_instances} "
                "decode instances: give one size, or one per instance"
            )
        for role, num_ranks in (("prefill", self.pcp * self.prefill_tp), ("decode", max(sizes))):
            if num_ranks > 1 and self.engine_for(role).kv_host_cache_gb > 0:
                raise PdserveError(
                    f"kv_host_cache_gb: the host tier needs one-rank engines for now, and {role} "
                    f"has {num_ranks} ranks (TP x PCP); set [{role}_engine] kv_host_cache_gb = 0"
                )
        for name in (
            "prefill_timeout_seconds",
            "first_token_timeout_seconds",
            "token_gap_timeout_seconds",
        ):
            if getattr(self, name) < 0:
                raise PdserveError(
                    f"{name} must be >= 0 (0: no deadline), got {getattr(self, name)}"
                )
        for name in ("lease_seconds", "heartbeat_seconds", "ping_seconds", "peer_timeout_seconds",
                     "body_read_timeout_seconds", "tokenize_timeout_seconds",
                     "grammar_compile_timeout_seconds", "http_header_timeout_seconds",
                     "http_keepalive_timeout_seconds"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise PdserveError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_seconds >= self.lease_seconds:
            raise PdserveError(
                f"heartbeat_seconds ({self.heartbeat_seconds:g}) must be less than lease_seconds "
                f"({self.lease_seconds:g}): leases of requests decode still waits for would expire"
            )
        if self.peer_timeout_seconds < 2 * self.ping_seconds:
            raise PdserveError(
                f"peer_timeout_seconds ({self.peer_timeout_seconds:g}) must be at least twice "
                f"ping_seconds ({self.ping_seconds:g}): one late ping must not mark a peer down"
            )
        if self.max_http_connections < 0:
            raise PdserveError(f"max_http_connections must be 0 (derived) or more, got "
                               f"{self.max_http_connections}")  # fmt: skip
        for name in ("max_requests_per_client", "max_prompts_per_request", "max_body_bytes",
                     "max_http_connections_per_client"):  # fmt: skip
            if getattr(self, name) < 1:
                raise PdserveError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_dispatched_per_client", "max_queued_per_client", "max_client_classes"):
            if getattr(self, name) < 0:
                raise PdserveError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.max_dispatched_requests < 0:
            raise PdserveError(f"max_dispatched_requests must be 0 (derived) or more, got "
                               f"{self.max_dispatched_requests}")  # fmt: skip
        if self.max_queued_requests < 1:
            raise PdserveError(
                f"max_queued_requests must be at least 1, got {self.max_queued_requests}"
            )
        if self.tool_call_parser not in ("auto", "llama3_json", "hermes"):
            raise PdserveError(f"tool_call_parser must be auto, llama3_json or hermes, got "
                               f"{self.tool_call_parser!r}")  # fmt: skip
        if self.reasoning_parser not in REASONING_PARSERS:
            raise PdserveError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                               f"got {self.reasoning_parser!r}")  # fmt: skip
        if any(not name for name in self.served_model_names):
            raise PdserveError("served_model_name: a model name must not be empty")
        if self.drain_seconds < 0:
            raise PdserveError(f"drain_seconds must be >= 0, got {self.drain_seconds}")
        if not 0 < self.restart_seconds <= self.restart_max_seconds:
            raise PdserveError(
                f"restart_seconds ({self.restart_seconds:g}) must be positive and at most "
                f"restart_max_seconds ({self.restart_max_seconds:g})"
            )

    @property
    def dispatch_window(self) -> int:
        """Requests the router dispatches at once: ``max_dispatched_requests``, else what
        the decode instances run at once (``max_num_seqs`` each) plus an eighth of that (at
        least 1) being prefilled meanwhile, so decode seldom waits for work. The decode
        queues first come, first served: a client's request given a slot waits there
        behind at most that eighth."""
        if self.max_dispatched_requests:
            return self.max_dispatched_requests
        running = self.engine_for("decode").max_num_seqs * self.decode_instances
        return running + max(1, running // 8)

    @property
    def dispatch_share(self) -> int:
        """Dispatch slots one client may hold: the decode seats (``max_num_seqs`` x
        instances) but an eighth of them (at least one), within the window. Those seats
        stay free for other clients' requests: a decode instance full of one client's
        requests started together frees its seats only when they end, together (64 tokens
        later), and a newcomer waited that long (issue 49: 56 s on a loaded 2-core CPU).
        With ``max_dispatched_requests`` set: that window but its last ninth."""
        window = self.dispatch_window
        if self.max_dispatched_requests:
            return max(1, window - max(1, window // 9))
        seats = self.engine_for("decode").max_num_seqs * self.decode_instances
        return max(1, min(window, seats) - max(1, seats // 8))

    @property
    def client_dispatch_share(self) -> int:
        """Dispatch slots one client may hold: ``max_dispatched_per_client``, else
        ``dispatch_share``; never more than the window."""
        share = self.max_dispatched_per_client or self.dispatch_share
        return min(share, self.dispatch_window)

    def decode_tp_of(self, instance: int) -> int:
        return self.decode_tp[instance] if isinstance(self.decode_tp, list) else self.decode_tp

    @property
    def served_model_names(self) -> list[str]:
        names = self.served_model_name
        return [names] if isinstance(names, str) else list(names)

    @property
    def http_keys(self) -> list[str]:
        """Every key the HTTP API takes (none: no key needed)."""
        return [k for k in [self.api_key, *self.api_keys] if k]

    @property
    def http_bind_host(self) -> str:
        return self.http_host or self.host

    @property
    def http_url(self) -> str:
        """Where a client on this machine reaches the HTTP API."""
        host = self.http_bind_host
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        return (
            f"http://[{host}]:{self.http_port}"
            if ":" in host
            else f"http://{host}:{self.http_port}"
        )

    @property
    def front_address(self) -> str:
        return self.router_address or f"tcp://{self.host}:{self.base_port}"

    @property
    def _derived(self) -> tuple[str, str]:
        """(advertised host, bind host) of derived addresses: a wildcard ``host`` binds
        every interface and is reached on this machine at 127.0.0.1."""
        if self.host in WILDCARD_HOSTS:
            return "127.0.0.1", self.host
        return self.host, ""

    @property
    def prefill_addresses(self) -> list[InstanceAddresses]:
        if self.prefill:
            return list(self.prefill)
        host, bind = self._derived
        return [
            InstanceAddresses(
                address=f"tcp://{host}:{self.base_port + 10 + 10 * i}",
                side_channel=f"tcp://{host}:{self.base_port + 11 + 10 * i}",
                bind_host=bind,
            )
            for i in range(self.prefill_instances)
        ]

    @property
    def decode_addresses(self) -> list[InstanceAddresses]:
        if self.decode:
            return list(self.decode)
        first = self.base_port + 10 + 10 * self.prefill_instances
        host, bind = self._derived
        return [
            InstanceAddresses(address=f"tcp://{host}:{first + 10 * i}", bind_host=bind)
            for i in range(self.decode_instances)
        ]

    def addresses_of(self, role: str) -> list[InstanceAddresses]:
        """The instances of ``role`` ("prefill" or "decode")."""
        return self.prefill_addresses if role == "prefill" else self.decode_addresses

    def engine_for(self, role: str) -> EngineConfig:
        """The engine config of ``role`` ("prefill" or "decode"), overrides applied."""
        overrides = self.prefill_engine if role == "prefill" else self.decode_engine
        base = msgspec.to_builtins(self.engine)
        base.update(model=self.model, device=self.device)
        base.update(overrides)
        if base.get("kv_order", "auto") == "auto":
            base["kv_order"] = self.kv_order
        if role == "prefill":
            base["speculative_config"] = None  # prefill ends at the first token: nothing to verify
        if role == "prefill" and "cuda_graphs" not in overrides:
            base["cuda_graphs"] = False  # prefill steps are prompt chunks: graphs would idle
        return _convert(base, EngineConfig, f"[{role}_engine]")

    @property
    def kv_order(self) -> str:
        """KV storage order for "auto": block-major when every decode instance has the
        prefill TP size (each decode rank reads whole producer ranks: one descriptor per
        run of blocks), head-major otherwise (one per head and run, any head slice)."""
        sizes = self.decode_tp if isinstance(self.decode_tp, list) else [self.decode_tp]
        return "block" if all(t == self.prefill_tp for t in sizes) else "head"


def load_config(path: str | os.PathLike[str] | None = None, **flags: Any) -> DeploymentConfig:
    """File < environment < flags (flags whose value is None are not given)."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
            # JSON is what `pdserve up` hands its children; people write TOML.
            raw = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
        except OSError as exc:
            raise PdserveError(f"cannot read config file {path}: {exc.strerror}") from exc
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise PdserveError(f"config file {path} is not valid TOML: {exc}") from exc
    _merge(raw, _from_env(os.environ))
    _merge(raw, {k: v for k, v in flags.items() if v is not None})
    return _convert(raw, DeploymentConfig, str(path or "configuration"))


def _from_env(environ: os._Environ[str] | dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fields = {f.name for f in msgspec.structs.fields(DeploymentConfig)}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        path = key[len(ENV_PREFIX) :].lower().split("__")
        if path[0] not in fields:  # PDSERVE_CACHE_DIR and the like belong to other parts
            continue
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _env_value(value)
    return out


def _env_value(value: str) -> Any:
    """Environment strings parsed as TOML values where they are ones (numbers, booleans,
    arrays), or as JSON objects, else kept as strings."""
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    if value.lstrip().startswith("{"):  # a JSON object: PDSERVE_ENGINE__SPECULATIVE_CONFIG
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass
    return value


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _convert(raw: dict[str, Any], kind: type, where: str) -> Any:
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise PdserveError(f"invalid {where}: {exc}") from exc


def torch_threads_for(cfg: DeploymentConfig, role: str) -> int:
    """The intra-op threads of a ``role`` ("prefill" or "decode") service: its own setting,
    else ``torch_threads``, else half the machine's cores (a lone ``pdserve prefill``)."""
    own = cfg.prefill_torch_threads if role == "prefill" else cfg.decode_torch_threads
    return own or cfg.torch_threads or max(1, (os.cpu_count() or 1) // 2)

"""Settings shared by the services. Each field is a ``--kebab-case`` flag and a ``SPECDEC_*``
environment variable (pydantic-settings); the flag wins over the variable."""

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, CliApp, CliSettingsSource, NoDecode, SettingsConfigDict

from specdec.rpc.delay_hook import parse_delays
from specdec.rpc.server import MAX_MESSAGE_BYTES
from specdec.rpc.tls import TLSFileError, server_ssl_context


def _split_commas(value):
    return [item.strip() for item in value.split(",") if item.strip()] if isinstance(value, str) else value


# A list setting given as one comma-separated string, on the command line or in the environment.
CommaSeparated = Annotated[list[str], NoDecode, BeforeValidator(_split_commas)]


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(cli_kebab_case=True, cli_implicit_flags=True, cli_avoid_json=True, extra="ignore")

    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0 for every interface).")
    port: int = Field(description="gRPC port.")
    log_level: str = Field("INFO", description="Python logging level.")
    log_format: Literal["text", "json"] = Field(
        "text", description="Log lines as text, or as JSON objects (one per line); both carry the trace id."
    )
    metrics_port: int = Field(0, description="HTTP port of the Prometheus /metrics endpoint (on host); 0 = off.")
    max_message_bytes: int = Field(
        MAX_MESSAGE_BYTES,
        ge=1024,
        description="Largest gRPC message this service sends or receives, and its "
        "channels to other services, in bytes (a larger one fails with RESOURCE_EXHAUSTED); sampling proposals "
        "carry K draft distributions of up to V * 8 bytes each. The coordinator reads its clients' requests up to "
        "its --max-request-bytes.",
    )
    tls_cert_file: str = Field(
        "",
        description="PEM certificate chain this service presents on its gRPC port (the coordinator: on its "
        "HTTP API too), with tls_key_file; empty: plaintext. Re-read when the file changes (new connections).",
    )
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file; re-read when the file changes.")
    tls_client_ca_file: str = Field(
        "",
        description="PEM CA bundle a client's certificate must be signed by (mutual TLS: a client without "
        "one is refused); needs tls_cert_file; empty: no client certificate asked for. Re-read when it changes.",
    )
    grpc_max_concurrent_streams: int = Field(
        256,
        ge=1,
        description="Calls (HTTP/2 streams) one client connection may have open at once on the gRPC port "
        "(grpc.max_concurrent_streams, announced to the client: a gRPC client queues its further calls until one "
        "ends); bounds what one connection's streams that never finish sending their request can hold.",
    )
    grpc_max_connection_idle_s: float = Field(
        300.0,
        ge=0,
        description="A gRPC connection without a call for this long is closed (GOAWAY; a gRPC client reconnects "
        "on its next call), seconds; 0 = never.",
    )
    grpc_max_connection_age_s: float = Field(
        0.0,
        ge=0,
        description="A gRPC connection this old is asked to close (GOAWAY: its client opens a new one for new "
        "calls), seconds; its calls in flight get grpc_max_connection_age_grace_s to finish, then are cut "
        "(UNAVAILABLE); 0 = never. Off on the draft and verify services: a coordinator's Step stream lives as "
        "long as its connection.",
    )
    grpc_max_connection_age_grace_s: float = Field(
        600.0,
        ge=0,
        description="How long the calls of a connection past grpc_max_connection_age_s may still run before "
        "they are cut, seconds.",
    )
    grpc_keepalive_time_s: float = Field(
        60.0,
        gt=0,
        description="The server pings a gRPC connection it has heard nothing on for this long, and closes it "
        "when no answer comes within grpc_keepalive_timeout_s (a client gone without closing), seconds.",
    )
    grpc_keepalive_timeout_s: float = Field(
        20.0, gt=0, description="How long the server waits for a ping's answer before it closes the connection (s)."
    )
    grpc_min_ping_interval_s: float = Field(
        300.0,
        ge=0,
        description="Shortest interval between a client's pings while the server sends nothing, seconds: each "
        "sooner ping is a strike, and past grpc_max_ping_strikes the connection is closed (GOAWAY "
        "ENHANCE_YOUR_CALM, too_many_pings).",
    )
    grpc_max_ping_strikes: int = Field(
        2, ge=1, description="Pings sooner than grpc_min_ping_interval_s a connection may send before it is closed."
    )
    insecure: bool = Field(
        False,
        description="Start without authenticating callers, which a service otherwise refuses to do: the draft "
        "and verify services then serve callers without a client certificate (no tls_client_ca_file: no mutual "
        "TLS), the coordinator callers without an API key (no api_keys and no keys in api_key_file; keys that are "
        "given are required all the same). Set by specdec up, demo and bench (on draft and verify without --tls, "
        "on the coordinator without keys) and by the local Kubernetes overlay; see docs/security.md.",
    )

    @model_validator(mode="after")
    def _tls_files(self):
        """Fails the start on unusable TLS files, naming the setting (TLSFileError is a ValueError)."""
        if not (self.tls_cert_file or self.tls_key_file or self.tls_client_ca_file):
            return self
        if not (self.tls_cert_file and self.tls_key_file):
            raise TLSFileError("tls_cert_file and tls_key_file: set both to serve TLS (tls_client_ca_file needs them)")
        server_ssl_context(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
        return self

    @classmethod
    def variable(cls, field: str) -> str:
        """The environment variable of setting ``field``: ``SPECDEC_DRAFT_DEFAULT_DRAFTER``."""
        return f"{cls.model_config.get('env_prefix', 'SPECDEC_')}{field.upper()}"

    @classmethod
    def named(cls, field: str) -> str:
        """Setting ``field`` as a start-up error names it, by its flag and its environment variable
        (as docs/settings.md lists them): ``--default-drafter (SPECDEC_DRAFT_DEFAULT_DRAFTER)``."""
        return f"--{field.replace('_', '-')} ({cls.variable(field)})"

    def require_authentication(self, authenticated: bool, missing: str, fix: str, callers: str) -> None:
        """Fails the start (ValueError) when callers are not ``authenticated`` and ``insecure`` is
        off, with a message naming what is ``missing``, how to ``fix`` it and the opt-out, which
        serves ``callers``."""
        if not (authenticated or self.insecure):
            raise ValueError(
                f"{missing} and not --insecure: {fix}, or start with --insecure ({self.variable('insecure')}=true) "
                f"to serve {callers}"
            )


RESERVED_WORKERS = 8  # handler threads beyond one per session: GetInfo, Release, health calls, Step streams


class SessionServiceSettings(ServiceSettings):
    """Settings of the services that hold per-session KV state (draft and verify)."""

    max_workers: int = Field(
        0,
        ge=0,
        description="Calls served at once: gRPC handler threads (each Prefill, unary Propose, Verify or Decode "
        "holds one while it waits for its step, each coordinator's Step stream one while it is open; the calls "
        "that arrive over a Step stream hold none); more wait in a queue. 0 = max(max_sessions, max_num_seqs) + 8: "
        "every session's call, and a few GetInfo, Release calls and streams at once. At least max_num_seqs, or a "
        "step of unary calls could never fill.",
    )
    num_threads: int = Field(0, description="torch CPU threads; 0 keeps torch's default.")
    max_sessions: int = Field(64, description="Open sessions allowed at once (RESOURCE_EXHAUSTED beyond).")
    session_idle_timeout_s: float = Field(300.0, description="Seconds before an unused session is released.")
    max_num_speculative_tokens: int = Field(16, description="Largest K a Propose / Verify call accepts.")
    max_num_seqs: int = Field(
        16,
        ge=1,
        description="Sequences (sessions) one batched forward (step) of a model takes at most; more wait "
        "for the next step (the llama-cpp drafter's steps take up to its --llama-cpp-max-num-seqs sequences).",
    )
    max_num_batched_tokens: int = Field(
        512,
        ge=1,
        description="New tokens one step takes at most (verify K + 1, decode or draft 1, prefill chunks "
        "fill the rest); at least max_num_speculative_tokens + 1.",
    )
    engine_step_timeout_s: float = Field(
        120.0,
        ge=0,
        description="Longest an engine step (one batched forward and its bookkeeping) may run, seconds; past "
        "it the engine is taken for hung: its calls fail with UNAVAILABLE, the service reports NOT_SERVING and "
        "exits with code 70, for its supervisor (specdec up, the kubelet) to restart it. 0 = no bound. The "
        "default is far above any step a CPU takes (a full prefill chunk of a 1B target: seconds), so only a "
        "hang reaches it; a slower device or a larger max_num_batched_tokens_alone may need more.",
    )
    debug_rpc_delay_ms: CommaSeparated = Field(
        [],
        description="Test hook, empty in production: METHOD=MS pairs (for example Prefill=1000); each call of "
        "that RPC (unary, or in a Step stream) waits MS ms before it is handled, so a fault test finds such calls "
        "in flight.",
    )

    @model_validator(mode="after")
    def _limits_agree(self):
        """Fills in max_workers and refuses limits that contradict each other (ValueError naming
        the settings to change): a step must be able to hold max_num_seqs calls and a verify of
        the largest K."""
        if self.max_workers == 0:
            self.max_workers = max(self.max_sessions, self.max_num_seqs) + RESERVED_WORKERS
        if self.max_workers < self.max_num_seqs:
            raise ValueError(
                f"max_workers ({self.max_workers}) is below max_num_seqs ({self.max_num_seqs}): each unary call waits "
                f"for its step in a handler thread, so no step could hold more than {self.max_workers} of them; raise "
                f"max_workers to at least {self.max_num_seqs} (0 chooses one thread per session) or lower max_num_seqs"
            )
        if self.max_num_batched_tokens < self.max_num_speculative_tokens + 1:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is below max_num_speculative_tokens + 1 "
                f"({self.max_num_speculative_tokens + 1}): a verify of the largest K could not fit one step; raise "
                "max_num_batched_tokens or lower max_num_speculative_tokens"
            )
        return self

    @model_validator(mode="after")
    def _mutual_tls_or_insecure(self):
        self.require_authentication(
            bool(self.tls_client_ca_file),
            "no mutual TLS (tls_client_ca_file)",
            "set --tls-cert-file, --tls-key-file and --tls-client-ca-file (the CA of the coordinator's client "
            "certificate)",
            "callers without a client certificate",
        )
        return self

    @field_validator("debug_rpc_delay_ms")
    @classmethod
    def _delays(cls, pairs: list[str]) -> list[str]:
        parse_delays(pairs)  # raises ValueError naming a malformed pair
        return pairs


def parse_settings(cls: type[ServiceSettings], args: list[str], prog: str) -> ServiceSettings:
    """Builds ``cls`` from command-line ``args`` and the environment; ``--help`` lists every field
    with its environment variable and exits."""
    source: CliSettingsSource[ServiceSettings] = CliSettingsSource(cls, cli_prog_name=prog, cli_show_env_vars=True)
    return CliApp.run(cls, cli_args=args, cli_settings_source=source)

import dataclasses
import os
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from coordinator.api.auth import MIN_KEY_BITS, key_bits
from specdec.engine.model_files import DEFAULT_MODEL
from specdec.lookups.ngram import NgramIndex
from specdec.rpc.tls import check_client_files
from specdec.sampling.structured_output import GrammarLimits
from specdec.settings import CommaSeparated, ServiceSettings

# Settings renamed, by their old name: their variables stop the start rather than go unread.
RENAMED = {"max_num_speculative_tokens": "adaptive_k_max"}


class CoordinatorSettings(ServiceSettings):
    """Settings of ``specdec serve coordinator`` (environment prefix ``SPECDEC_COORDINATOR_``)."""

    model_config = ServiceSettings.model_config | {
        "env_prefix": "SPECDEC_COORDINATOR_",
        "populate_by_name": True,
        "cli_shortcuts": {"api-keys": "api-key"},
    }

    port: int = Field(50051, description="gRPC port of the public Generate API.")
    http_port: int = Field(
        8000,
        description="Port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health), served beside the gRPC port; 0 = off.",
    )
    served_model_name: CommaSeparated = Field(
        [],
        description="Names the HTTP API also accepts as `model` and lists in /v1/models, besides the "
        "target's own (repeatable or comma-separated).",
    )
    api_keys: CommaSeparated = Field(
        [],
        validation_alias="SPECDEC_API_KEYS",
        description="API keys (--api-key, repeatable, or "
        "comma-separated; also SPECDEC_API_KEYS, or SPECDEC_COORDINATOR_API_KEYS): every call to the public APIs "
        "must carry one, as `Authorization: Bearer <key>` on HTTP and `authorization` metadata on gRPC "
        "(health checks stay open); none = no authentication.",
    )
    max_streams_per_client: int = Field(
        32,
        ge=0,
        description="Requests one client may run at once on every coordinator replica together (counted in "
        "the request store: Redis when redis_url is set, else this coordinator alone): gRPC Generate streams and "
        "HTTP completions (streamed or not), each choice of a request with n > 1 counted, a client being its API "
        "key when keys are set, else its IP address; one more gets RESOURCE_EXHAUSTED (HTTP 429 with Retry-After); "
        "0 = no limit. The default is half a verify service's default max_sessions, so one client cannot take "
        "every session.",
    )
    max_concurrent_rpcs: int = Field(
        1024,
        ge=0,
        description="Generate calls the coordinator's gRPC server runs at once, each counted from the moment its "
        "request message has arrived (with an accepted API key) until it ends; one more gets RESOURCE_EXHAUSTED "
        "at once instead of queueing without bound; health checks, reflection and calls without a key never "
        "count; 0 = no limit. The HTTP API's connections are bounded by http_max_connections.",
    )
    grpc_max_connection_age_s: float = Field(
        3600.0,
        ge=0,
        description="A connection to the public gRPC port this old is asked to close (GOAWAY: its client opens a "
        "new one for new calls), seconds; its Generate streams get grpc_max_connection_age_grace_s to finish, "
        "then are cut (UNAVAILABLE: resume them with resume_from); 0 = never. Behind a layer-4 load balancer it "
        "also spreads long-lived clients over new coordinator replicas.",
    )
    grpc_request_message_timeout_s: float = Field(
        10.0,
        ge=0,
        description="A gRPC call's request message must have arrived whole within this long of the call's start "
        "(a request stream's each message, of the previous one), seconds, or the call ends with DEADLINE_EXCEEDED "
        "and what it sent is freed: gRPC keeps the part of a message that has arrived until the rest comes, so a "
        "client sending a large message slowly, or not at all, would hold that memory. Health checks and "
        "reflection included; 0 = no bound.",
    )
    max_queued_requests: int = Field(
        256,
        ge=0,
        description="Requests that may wait at this coordinator for room on the verify service (every replica "
        "refused them for being full), served round-robin across clients; one more gets RESOURCE_EXHAUSTED (HTTP "
        "429 with Retry-After). 0 = no queue: a full verify service refuses at once.",
    )
    queue_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest a request waits in that queue before it gets RESOURCE_EXHAUSTED (HTTP 429), seconds.",
    )
    stream_stall_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A streamed response whose client reads nothing for this long (its messages back up in "
        "the connection's flow-control window) is cut and its request cancelled, releasing its sessions, seconds.",
    )
    max_stop_strings: int = Field(
        16,
        ge=0,
        description="Most stop strings a request may give (OpenAI allows 4); more gets INVALID_ARGUMENT (HTTP 400).",
    )
    max_stop_string_bytes: int = Field(
        256,
        ge=1,
        description="Longest stop string a request may give, UTF-8 bytes; a longer one gets INVALID_ARGUMENT "
        "(HTTP 400). Text that may begin one is held back from the stream, up to this much.",
    )
    http_header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="An HTTP connection must send a request's whole header within this long of opening (or of "
        "the previous response's end) or it is closed, seconds: slow senders cannot hold connections.",
    )
    http_keep_alive_timeout_s: float = Field(
        5.0, gt=0, description="An idle keep-alive HTTP connection is closed after this long, seconds."
    )
    http_max_connections: int = Field(
        1024,
        ge=1,
        description="HTTP connections (and requests in progress) the HTTP API serves at once; a request past it "
        "gets 503 (uvicorn's limit_concurrency).",
    )
    http_body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="An HTTP request's whole body must arrive within this long of its header, seconds; a slower "
        "one gets 408 and its connection is closed: slow senders cannot hold a connection mid-body.",
    )
    http_max_header_bytes: int = Field(
        32 * 1024,
        ge=1024,
        description="Largest HTTP request header a client may send (the request line and every header field), "
        "bytes; a larger one gets 431 and its connection is closed.",
    )
    http_max_headers: int = Field(
        100,
        ge=1,
        description="Most header fields an HTTP request may have; more gets 431 and its connection is closed.",
    )
    http_max_pending_bodies_per_client: int = Field(
        32,
        ge=0,
        description="HTTP requests of one client (its API key when keys are set, else its IP address) whose body "
        "is still arriving, at once; one more gets 429 with Retry-After and its connection is closed, so one client "
        "cannot park connections mid-body and starve the others. 0 = no limit.",
    )
    max_chat_messages: int = Field(
        2048,
        ge=1,
        description="Most messages a chat request may give (gRPC chat.messages, HTTP messages), checked before "
        "they are parsed or templated; more gets INVALID_ARGUMENT (HTTP 400).",
    )
    max_n: int = Field(
        8,
        ge=1,
        description="Largest n (choices of one request, each run as its own request) a request may ask for; more "
        "gets INVALID_ARGUMENT (HTTP 400).",
    )
    max_logprobs: int = Field(
        20,
        ge=0,
        description="Largest top_logprobs (the most likely tokens listed at each generated position) a request "
        "may ask for, as vLLM's max_logprobs; more gets INVALID_ARGUMENT (HTTP 400).",
    )
    max_request_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        description="Largest request the public APIs read, in bytes: a gRPC GenerateRequest "
        "(RESOURCE_EXHAUSTED beyond) or an HTTP request body (413 beyond). A prompt is tokenized before its length is "
        "checked, so this also bounds that work.",
    )
    api_key_file: str = Field(
        "",
        description="A file of further API keys, one per line (blank lines and # comments skipped); a file that "
        "cannot be read stops the coordinator's start.",
    )
    shared_caches: bool = Field(
        False,
        description="Share the services' prefix caches, the suffix lookup's cache of outputs and the learnt "
        "acceptance estimates across API keys (a trusted deployment whose keys all serve one tenant). Off: each "
        "key has a partition of its own, so no key's cached tokens, timings or draft proposals depend on "
        "another's prompts or outputs (docs/security.md#tenants-and-the-caches). A request's own cache_salt "
        "partitions either way.",
    )
    draft_addresses: CommaSeparated = Field(
        [],
        description="host:port of every draft replica (a draft pool), comma-separated; a host may be a DNS name, "
        "which stands for every address it resolves to (a Kubernetes headless Service: every ready pod), resolved "
        "again every discovery_refresh_s. A session opens on the replica placement chooses and moves to another "
        "when its replica fails. Empty: draft_address.",
    )
    draft_address: str = Field(
        "127.0.0.1:50052", description="host:port of the draft service when it is one replica (see draft_addresses)."
    )
    verify_addresses: CommaSeparated = Field(
        ["127.0.0.1:50053"],
        description="host:port of every verify replica, comma-separated; a host may be a DNS name, as in "
        "draft_addresses. A session opens on the replica placement chooses and is rebuilt on another when its "
        "replica fails or is no longer found.",
    )
    placement: Literal["prefix-load", "round-robin"] = Field(
        "prefix-load",
        description="How a new session's replica is chosen (draft and verify): prefix-load, the replica that "
        "holds most of the prompt in its prefix cache unless it is a share busier than the others, else the least "
        "loaded (load from the replicas' reports and the round trip of their calls; docs/architecture.md#placement); "
        "round-robin, one after the other.",
    )
    discovery_refresh_s: float = Field(
        10.0,
        gt=0,
        description="How often the DNS names in draft_addresses and verify_addresses are resolved again (also "
        "within a second after a replica fails to answer), seconds.",
    )
    dns_nameservers: CommaSeparated = Field(
        [],
        description="host:port of DNS servers to resolve the replicas' names with (A and AAAA queries); empty: the "
        "operating system's resolver (/etc/hosts, and the search domains of /etc/resolv.conf, as a pod's).",
    )
    tokenizer: str = Field(
        DEFAULT_MODEL,
        description="The target's tokenizer (same spec as the verify service's --model); checked "
        "against the target's vocabulary fingerprint.",
    )
    adaptive: bool = Field(
        True,
        description="Choose K every round for requests that set no num_speculative_tokens "
        "(0 = plain decode when speculation does not pay); off: they get num_speculative_tokens.",
    )
    adaptive_k_max: int = Field(
        8,
        description="Largest K (num_speculative_tokens) the adaptive choice makes; with structured output, the "
        "tokens the grammar forces (free: no draft forward) come on top of it, up to the verify service's largest K "
        "(its --max-num-speculative-tokens, the per-call limit). Formerly max_num_speculative_tokens, whose variable "
        "now stops the start.",
    )
    probe_interval: int = Field(
        16,
        description="While adaptive K falls back to plain decode, every this many rounds (times what a "
        "probe costs over a plain round) a 2-token proposal probes whether speculation pays again.",
    )
    step_budget: bool = Field(
        True,
        description="Under adaptive K, cap each request's K at its share of one speculation budget per verify step "
        "over the coordinator's running requests on the target (greedy marginal goodput, as in SmartSpec); "
        "off: each request prices its own round alone.",
    )
    hybrid: bool = Field(
        True,
        description="Under adaptive K, let the coordinator's own lookups (hybrid_lookups) compete "
        "with the request's drafter every round (hybrid drafting); off: the drafter and plain decode only.",
    )
    hybrid_lookups: CommaSeparated = Field(
        ["ngram", "suffix"],
        description="The coordinator's own model-free lookups that compete in hybrid drafting "
        "(comma-separated): ngram (prompt lookup: what followed the latest match) and suffix (SuffixDecoding: the "
        "most frequent continuation over the request and earlier outputs).",
    )
    suffix_max_cached_requests: int = Field(
        256,
        description="The suffix lookup's cache of earlier and running requests' outputs, shared by this "
        "coordinator's requests: at most this many outputs (0 = no cache: each request's own prompt and output only).",
    )
    suffix_max_cached_tokens: int = Field(
        16384, description="...and at most this many tokens, the oldest output evicted first."
    )
    suffix_max_cache_partitions: int = Field(
        64,
        ge=1,
        description="Partitions of that cache (one per cache salt: an API key's, or one a request names), a "
        "request drafting only from its own partition's outputs; a new one drops the least recently used whole. "
        "The requests and tokens above bound all partitions together, the partition holding most giving first.",
    )
    draft_shares_target_cores: bool = Field(
        False,
        description="The draft service runs on the target's cores (one machine, no device of its own). Then a "
        "greedy request's draft prefills once the target's prefill has given the first token, so that it does not "
        "slow the target's prefill (the first token as fast as plain decoding; the first round waits for it, as "
        "plain rounds beside it would share the cores with it), and draft-ahead drafts one branch only, as any "
        "other would take its forwards from the target's. Off (a draft on its own device, as deployed): the draft "
        "prefills beside the target's prefill, ready for the first round, and draft-ahead drafts up to "
        "draft_ahead_branches branches while the target verifies. Sampled requests always prefill the draft with "
        "the target (their first round waits for it).",
    )
    draft_ahead_branches: int = Field(
        1,
        ge=1,
        le=16,
        description="Draft-ahead: proposals drafted for the next round per round, one per likely outcome of the "
        "verification under way (every token accepted with the draft's first and second guess of the bonus token, "
        "a rejection followed by the draft's second choice there), most likely first, as many as the draft "
        "drafts while the target verifies; 1 (the default): the first outcome only. Each other branch costs K "
        "draft forwards and, since the branches share the session's one sequence, the first outcome's tokens fed "
        "again before the next proactive draft; more pay only where the draft's second choices are often the "
        "target's tokens (SmolLM2's self-draft at batch 1, split placement: 0-7% of the other branches hit, and "
        "3 branches read 0.92-0.93x the speedup of 1). With draft_shares_target_cores, and for sampled "
        "requests (whose sampled tokens a branch rarely matches): 1.",
    )
    draft_ahead: bool = Field(
        True,
        description="While the verify service checks a round's proposal, have a model drafter draft the "
        "next round's on the branch where all of it is accepted and the bonus token is the draft's guess, so "
        "that it is ready when verification goes that way (hiding the draft's time); off: every round drafts "
        "after the previous one is verified.",
    )
    decode_ahead: bool = Field(
        True,
        description="Where a plain decode round is followed by another (K = 0, or adaptive K decoding plainly), "
        "send the next round's Decode with this one's, before its answer: the verify service runs it in the next "
        "step without waiting for the coordinator's turnaround (a network round trip in it); off: every Decode is "
        "sent after the last one's answer.",
    )
    grammar_aware_drafting: bool = Field(
        True,
        description="Structured output under adaptive K: the coordinator proposes the tokens the request's "
        "grammar forces (a lookup with no draft call) and prices the forced tokens of a model drafter's "
        "proposal as free (no draft forward); off: neither (set it off on the draft service too to compare "
        "against drafting without the grammar, as specdec bench structured does).",
    )
    grammar_max_spec_bytes: int = Field(
        GrammarLimits.max_spec_bytes,
        ge=1,
        description="Largest structured-output spec a request may send (JSON schema, regex, choices or grammar "
        "text), UTF-8 bytes; a larger one gets INVALID_ARGUMENT (HTTP 400). The draft and verify services trust "
        "this check (they set no limit of their own).",
    )
    grammar_max_symbols: int = Field(
        GrammarLimits.max_symbols,
        ge=1,
        description="Largest compiled grammar a structured-output spec may make, in symbols (llguidance's "
        "max_grammar_size); a larger one gets INVALID_ARGUMENT (HTTP 400).",
    )
    grammar_max_lexer_fuel: int = Field(
        GrammarLimits.max_lexer_fuel,
        ge=1,
        description="Most work building a structured-output grammar's lexer may take (llguidance's "
        "initial_lexer_fuel, about 50,000 per ms: the default bounds a compile near 20 ms); a grammar that needs "
        "more gets INVALID_ARGUMENT (HTTP 400).",
    )
    ngram_min: int = Field(
        1,
        description="Shortest suffix n-gram the coordinator's own prompt lookup (hybrid drafting under "
        "adaptive K) matches.",
    )
    ngram_max: int = Field(
        3, description="Longest suffix n-gram the coordinator's own prompt lookup matches (tried first)."
    )
    num_speculative_tokens: int = Field(4, description="K of requests that set none, when adaptive is off.")
    default_max_new_tokens: int = Field(128, description="max_new_tokens when a request sets none.")
    max_new_tokens_limit: int = Field(4096, description="Largest max_new_tokens a request may ask for.")
    rpc_timeout_s: float = Field(
        30.0,
        description="Deadline of every other call to the draft and verify services (Verify, Decode, GetInfo, "
        "Release), and the most a Propose deadline may grow to, seconds.",
    )
    propose_timeout_floor_s: float = Field(
        0.25,
        gt=0,
        description="Least deadline of a Propose call, seconds. Each Propose gets propose_timeout_factor "
        "times the slowest of the last 64 Propose round trips (scaled to the draft forwards it costs; calls "
        "answered after their deadline count too, so the deadline follows a burst of load), at least this; a draft "
        "that misses it is skipped for draft_retry_s (plain decode meanwhile), so a hung draft delays a request "
        "about this long, not rpc_timeout_s.",
    )
    propose_timeout_factor: float = Field(
        3.0,
        ge=1,
        description="Propose deadline as a multiple of the slowest recent Propose round trip (see "
        "propose_timeout_floor_s).",
    )
    prefill_timeout_s: float = Field(120.0, description="Deadline of each Prefill call, seconds.")
    failover_timeout_s: float = Field(
        60.0,
        description="How long a request whose verify replica failed keeps trying to rebuild its session "
        "on a replica before failing with UNAVAILABLE, seconds.",
    )
    draft_retry_s: float = Field(
        2.0,
        description="After the draft service fails, a request runs without it (plain decode) for this "
        "many seconds, then tries it again, seconds.",
    )
    redis_url: str = Field(
        "",
        validation_alias="SPECDEC_REDIS_URL",
        description="Redis URL of the request store shared by the "
        "coordinator replicas (redis://host:6379/0; rediss:// for TLS); empty: a store inside this process.",
    )
    redis_cluster: bool = Field(
        False,
        description="redis_url names a node of a Redis Cluster, not one Redis: the requests are spread over the "
        "cluster's masters (a request's keys in one slot), and after a master fails the coordinators follow the "
        "replica promoted in its place. The URL's host seeds the client with every node: a DNS name that resolves "
        "to every node (a Kubernetes headless Service) stays the seed, resolved again at each new connection; an IP "
        "address seeds once (the nodes it reports are the seeds after). Password, rediss:// and redis_tls_* as for "
        "one Redis (over TLS each node's certificate must name the address the cluster announces it by); the URL's "
        "database must be 0.",
    )
    redis_tls_ca_file: str = Field(
        "",
        description="PEM CA bundle Redis's certificate is checked against, for a rediss:// redis_url (redis-py's "
        "ssl_ca_certs); empty: the system's roots.",
    )
    redis_tls_cert_file: str = Field(
        "",
        description="PEM client certificate for a Redis that asks for one (redis-py's ssl_certfile), with "
        "redis_tls_key_file; empty: none. The password goes in the URL: rediss://:PASSWORD@host:6379/0.",
    )
    redis_tls_key_file: str = Field("", description="PEM private key of redis_tls_cert_file (redis-py's ssl_keyfile).")
    internal_tls_ca_file: str = Field(
        "",
        description="PEM CA bundle the draft and verify services' certificates are checked against; set: the "
        "coordinator connects to them over TLS; empty: plaintext.",
    )
    internal_tls_cert_file: str = Field(
        "",
        description="PEM client certificate the coordinator presents to the draft and verify services (mutual "
        "TLS: theirs --tls-client-ca-file signed it), with internal_tls_key_file; needs internal_tls_ca_file. "
        "Re-read when the file changes (new connections).",
    )
    internal_tls_key_file: str = Field("", description="PEM private key of internal_tls_cert_file.")
    request_ttl_s: float = Field(
        3600.0,
        description="How long the request store keeps a request after its last write (resumable that long), seconds.",
    )
    max_stored_request_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="Largest request the request store keeps, in bytes: the GenerateRequest as sent (the HTTP API's "
        "as it builds it), unknown protobuf fields dropped; a larger one gets INVALID_ARGUMENT (HTTP 400) before any "
        "work. With max_new_tokens_limit and max_logprobs it bounds a stored record "
        "(docs/scaling.md#the-request-stores-memory).",
    )
    max_finished_requests_per_client: int = Field(
        256,
        ge=0,
        description="Ended requests (finished, failed or cancelled) the request store keeps per client, resumable "
        "for request_ttl_s; the client's oldest beyond it is dropped (a resume of it gets NOT_FOUND). With "
        "max_streams_per_client (its running ones) it bounds what one client keeps in the store; 0 = no bound but "
        "request_ttl_s.",
    )
    max_coordinator_replicas: int = Field(
        1,
        ge=1,
        description="The most coordinator replicas that run at once (an autoscaler's maxReplicas). While the request "
        "store cannot be reached each coordinator admits max_streams_per_client / this (rounded down) of a client's "
        "requests, counted alone, so that together they stay within the limit; 0 of them (a limit below the "
        "replicas) gets RESOURCE_EXHAUSTED until the store answers.",
    )
    owner_hash_secret: str = Field(
        "",
        description="The secret the owner hash of an API key is keyed with (HMAC-SHA256): the name a request is "
        "stored under in the request store. Every coordinator sharing a store needs the same one (Kubernetes: the "
        "Secret of the API keys); changing it makes the stored requests unreachable (a resume gets NOT_FOUND). "
        "Empty: a public constant, with a warning at start: anyone reading Redis's key names could then test a "
        "guessed key offline.",
    )
    owner_hash_secret_file: str = Field(
        "",
        description="A file whose content (surrounding whitespace stripped) is owner_hash_secret, for a secret "
        "mounted as a file (Kubernetes); a file that cannot be read stops the coordinator's start, and so does "
        "giving both.",
    )
    allow_short_api_keys: bool = Field(
        False,
        description="INSECURE: start with API keys under 128 bits (key length x log2 of its alphabet: digits, lower "
        "and upper case letters, other characters); off, such a key stops the start. For tests and demos only: a "
        "short key can be guessed, online or, from its owner hash, offline.",
    )
    max_stream_wait_s: float = Field(
        60.0,
        gt=0,
        description="The most a request's client may keep the coordinator waiting in all, summed over its messages "
        "(each one's wait bounded by stream_stall_timeout_s): the time from a message's handing to the API to its "
        "written; past it the stream is cut (UNAVAILABLE; over HTTP the connection closes) and its request "
        "cancelled, its sessions released. A reader that keeps up waits for nothing; one that reads a message every "
        "29 s no longer holds its sessions for ever, seconds.",
    )

    def grammar_limits(self) -> GrammarLimits:
        """The structured-output limits of ``grammar_<field>``, every request checked against them."""
        return GrammarLimits(**{f.name: getattr(self, f"grammar_{f.name}") for f in dataclasses.fields(GrammarLimits)})

    @model_validator(mode="after")
    def _read_api_key_file(self):
        if self.api_key_file:
            try:
                lines = Path(self.api_key_file).read_text().splitlines()
            except OSError as err:  # fails the start
                raise ValueError(
                    f"api_key_file {self.api_key_file}: {err.strerror}: give a readable file of keys"
                ) from None
            self.api_keys = [
                *self.api_keys,
                *(k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")),
            ]
        return self

    @model_validator(mode="after")
    def _read_owner_hash_secret_file(self):
        if self.owner_hash_secret_file:
            if self.owner_hash_secret:
                raise ValueError("give owner_hash_secret or owner_hash_secret_file, not both")
            try:
                self.owner_hash_secret = Path(self.owner_hash_secret_file).read_text().strip()
            except OSError as err:  # fails the start
                raise ValueError(
                    f"owner_hash_secret_file {self.owner_hash_secret_file}: {err.strerror}: give a readable file"
                ) from None
        return self

    @model_validator(mode="after")
    def _api_keys_or_insecure(self):  # after _read_api_key_file, which adds the file's keys
        self.require_authentication(
            bool(self.api_keys),
            "no API keys (--api-key / SPECDEC_COORDINATOR_API_KEYS, or --api-key-file)",
            "set keys",
            "callers without an API key",
        )
        return self

    @model_validator(mode="after")
    def _strong_api_keys(self):  # after _read_api_key_file, which adds the file's keys
        """Fails the start on an API key under MIN_KEY_BITS, unless allow_short_api_keys; the
        message names the key by its place, never the key."""
        weak = [i for i, key in enumerate(self.api_keys, 1) if key_bits(key) < MIN_KEY_BITS]
        if weak and not self.allow_short_api_keys:
            raise ValueError(
                f"API key number {', '.join(map(str, weak))} of {len(self.api_keys)} (--api-key, then --api-key-file) "
                f"has under {MIN_KEY_BITS} bits (length x log2 of its alphabet): use random keys of at least 22 "
                "base64 or 32 hex characters (openssl rand -hex 32), or start with --allow-short-api-keys "
                "(insecure: tests and demos only)"
            )
        return self

    @model_validator(mode="after")
    def _client_tls_files(self):
        """Fails the start on unusable client TLS files, naming the setting."""
        if (self.internal_tls_cert_file or self.internal_tls_key_file) and not self.internal_tls_ca_file:
            raise ValueError(
                "internal_tls_cert_file needs internal_tls_ca_file: set the CA of the draft and verify "
                "services' certificates"
            )
        redis_tls = self.redis_tls_ca_file or self.redis_tls_cert_file or self.redis_tls_key_file
        if redis_tls and not self.redis_url.startswith("rediss://"):
            raise ValueError("redis_tls_* files are for a TLS connection: make redis_url rediss://host:port/db")
        for prefix in ("internal_tls_", "redis_tls_"):
            names = (f"{prefix}ca_file", f"{prefix}cert_file", f"{prefix}key_file")
            ca_file, cert_file, key_file = (getattr(self, name) for name in names)
            check_client_files(ca_file, cert_file, key_file, names)
        return self

    @model_validator(mode="after")
    def _redis_cluster_url(self):
        """Fails the start on a redis_cluster without a URL that can name a cluster, naming what to change."""
        if not self.redis_cluster:
            return self
        if not self.redis_url:
            raise ValueError(
                "redis_cluster needs redis_url: set it to a node of the cluster (redis://host:6379/0, rediss:// for "
                "TLS), or a DNS name of its nodes"
            )
        database = urlsplit(self.redis_url).path.strip("/")
        if database not in ("", "0"):
            raise ValueError(
                f"redis_url names database {database}, but a Redis Cluster has database 0 only: end redis_url with "
                "/0, or unset redis_cluster for one Redis"
            )
        return self

    @model_validator(mode="after")
    def _draft_replicas(self):
        """Fills draft_addresses from draft_address; refuses both set (which one would win?)."""
        if self.draft_addresses and "draft_address" in self.model_fields_set:
            raise ValueError("draft_addresses and draft_address are both set: give every replica in draft_addresses")
        if not self.draft_addresses:
            self.draft_addresses = [self.draft_address]
        return self

    @model_validator(mode="after")
    def _no_renamed_variables(self):
        """Refuses the environment variable of a renamed setting, which would otherwise be ignored
        without a word (its flag is refused as unknown)."""
        for old, new in RENAMED.items():
            if f"SPECDEC_COORDINATOR_{old.upper()}" in os.environ:
                raise ValueError(
                    f"SPECDEC_COORDINATOR_{old.upper()} is set: the setting is now {new}; set "
                    f"SPECDEC_COORDINATOR_{new.upper()} (--{new.replace('_', '-')}) instead"
                )
        return self

    @model_validator(mode="after")
    def _known_lookups(self):
        unknown = [name for name in self.hybrid_lookups if name not in ("ngram", "suffix")]
        if unknown:
            raise ValueError(f"hybrid_lookups {unknown}: choose among ngram, suffix")
        return self

    @model_validator(mode="after")
    def _ngram_bounds(self):
        NgramIndex(self.ngram_min, self.ngram_max)  # raises ValueError for bad bounds
        return self

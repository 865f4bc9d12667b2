"""The gateway's settings: one `BaseSettings`, read from `SWITCHBOARD_*` environment variables.

Built by `create_app` (or the `switchboard gateway` command), never at import time, so tests
and tools can construct several with different values side by side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.request_model import MAX_PARSED_ITEMS
from gateway.tenancy.weights import check_tiers
from runtime.home import default_adapter_store, default_model_dir

# Secrets that appear in docs, examples and muscle memory: never acceptable outside dev mode.
DEFAULT_SECRETS = frozenset({"", "admin", "changeme", "change-me", "secret", "password", "token"})
MIN_ADMIN_TOKEN_CHARS = 16


class GatewaySettings(BaseSettings):
    """Everything the gateway process needs; `SWITCHBOARD_ADMIN_TOKEN=...` sets `admin_token`."""

    model_config = SettingsConfigDict(env_prefix="SWITCHBOARD_", extra="ignore")

    # Shared state: tenants, hashed keys, adapter metadata and the worker registry.
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Waits for a free connection instead of failing past the limit (redis-py's default pool
    # raises MaxConnectionsError at 100 concurrent commands).
    redis_max_connections: int = Field(default=64, ge=1)
    redis_timeout_s: float = Field(default=5.0, gt=0)
    # Every key starts with it, so several deployments (or tests) can share one Redis.
    key_prefix: str = "sb:"

    # How the gateway proves itself to workers (worker/serving/auth.py). With any of these set every
    # worker is dialled over TLS; with none, loopback workers in plaintext and any other over
    # TLS against the system's roots (never plaintext off this machine).
    # The CA that signed the workers' certificates (PEM).
    worker_tls_ca: Path | None = None
    # The gateway's client certificate and key (PEM), for workers that require mutual TLS.
    worker_tls_cert: Path | None = None
    worker_tls_key: Path | None = None
    # The name checked on a worker's certificate: workers are dialled by pod IP, which no
    # certificate made in advance names (runtime/certs.py WORKER_NAME). "": the address.
    worker_tls_server_name: str = "switchboard-worker"
    # A shared secret sent as gRPC call credentials (`authorization: Bearer …`), over TLS.
    worker_token: SecretStr = SecretStr("")

    admin_token: SecretStr = SecretStr("")
    # Allows an empty or well-known admin token: for a laptop, never for a deployment.
    dev_mode: bool = False

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # Idle keep-alive connections are closed after this; keep it above clients' own expiry.
    http_keep_alive_s: float = Field(default=75.0, gt=0)
    # Slowloris bounds: a request's line and headers must all arrive within this of the
    # connection opening (or of the first byte of a kept-alive connection's next request),
    # and a body may pause at most body_timeout_s between chunks (408 past it).
    http_header_timeout_s: float = Field(default=10.0, gt=0)
    http_body_timeout_s: float = Field(default=30.0, gt=0)
    # Open connections (and running requests) past which uvicorn answers 503 at once.
    http_max_connections: int = Field(default=2048, ge=1)
    http_backlog: int = Field(default=2048, ge=1)
    # The request line plus headers, in bytes (h11's max incomplete event): 431/400 past it.
    http_max_header_bytes: int = Field(default=16 << 10, ge=1024)
    # Request bodies, refused with 413 from Content-Length (or as they stream) before any
    # parsing or authentication. Completions and chat: a whole context of text with room to
    # spare; uploads: max_upload_bytes; every other route (admin, usage): small.
    max_request_body_bytes: int = Field(default=4 << 20, ge=1024)
    max_small_body_bytes: int = Field(default=64 << 10, ge=1024)

    # /admin (and the admin-token /metrics): None serves them on `port`; a number serves them
    # only on that port of admin_host (0: any free one, logged), never on `port`.
    admin_port: int | None = Field(default=None, ge=0, le=65535)
    admin_host: str = "127.0.0.1"
    # False: no /admin routes at all (manage tenants with another gateway that has them).
    admin_api: bool = True
    # /docs and /openapi.json, beside /admin (on admin_port when set); None: on in dev mode.
    docs: bool | None = None

    # Request shape (each past its bound is a 400 naming the field).
    # At most the workers' own limits (worker/sampling/sampling_params.py: 32, 1024, 1024), so the
    # gateway never forwards what a worker would refuse.
    max_stop_strings: int = Field(default=16, ge=0, le=32)
    max_stop_string_chars: int = Field(default=256, ge=1, le=1024)
    max_stop_token_ids: int = Field(default=64, ge=0, le=1024)
    max_chat_messages: int = Field(default=1024, ge=1, le=MAX_PARSED_ITEMS)
    # Adapters one request may mix (`adapters`): each holds a worker's adapter slot while the
    # request runs. At most the workers' own limit (worker/core/adapter_mix.py: 8; a worker also
    # refuses a mix larger than its max_loras).
    max_mix_adapters: int = Field(default=4, ge=1, le=8)
    # n (or best_of) × max_tokens: tokens one request may ask the workers to generate. A
    # request without max_tokens gets its default cut to fit instead of a 400.
    max_generated_tokens: int = Field(default=16384, ge=1)
    # Threads that tokenize and render chat templates (off the event loop).
    tokenizer_threads: int = Field(default=2, ge=1)

    # Structured outputs and tool calls (gateway/structured/grammar_checker.py). A grammar's text
    # (JSON schema, regex, Lark, the tools' grammar) past max_grammar_bytes is a 400 before it is
    # compiled; each is checked in a child process (grammar_checkers at once, each check killed past
    # grammar_check_timeout_s), and verdicts are cached by content. The checkers are shared fairly:
    # a tenant runs at most grammar_checks_per_tenant checks at once and queues at most
    # grammar_check_queue_per_tenant more (past that, 429), so one tenant's flood of pathological
    # grammars never holds every checker (gateway/fair_slots.py).
    max_grammar_bytes: int = Field(default=256 << 10, ge=1024, le=1 << 20)
    grammar_checkers: int = Field(default=2, ge=1)
    grammar_checks_per_tenant: int = Field(default=1, ge=1)
    grammar_check_queue_per_tenant: int = Field(default=16, ge=1)
    grammar_check_timeout_s: float = Field(default=10.0, gt=0)
    grammar_cache_entries: int = Field(default=1024, ge=1)

    # Prometheus' own port, unauthenticated, on `host`: metric labels name tenants and
    # adapters, so the HTTP port's /metrics needs the admin token and Prometheus scrapes here
    # (a port kept out of the Service; the NetworkPolicy opens it for scraping only).
    # None: no separate listener; 0: any free port (logged).
    metrics_port: int | None = Field(default=None, ge=0, le=65535)

    # The base checkpoint directory: the gateway reads only its tokenizer, chat template and
    # config.json (for the context length and to validate adapters), never its weights.
    model: Path = Field(default_factory=default_model_dir)
    # The name clients put in `model`; default: the checkpoint directory's name.
    served_model_name: str = ""
    # Context length of the default base; 0: the checkpoint's max_position_embeddings.
    max_model_len: int = Field(default=0, ge=0)
    # Directories under which the gateway may read other bases' tokenizer files and config,
    # from the checkpoint directory their workers publish in the registry (a JSON list);
    # empty: only `model` itself. A base added under a root is served without a restart.
    model_roots: list[Path] = Field(default_factory=list)

    # Whole-request deadline (queueing, prefill and every token), sent to the worker as the
    # gRPC deadline; past it the client gets 504 (or an error event mid-stream).
    request_timeout_s: float = Field(default=600.0, gt=0)

    # Where registered adapters are stored by content id (a volume the workers read too).
    adapter_store: Path = Field(default_factory=default_adapter_store)
    # Object storage for adapters (`s3://bucket/prefix`); empty: the filesystem store at
    # `adapter_store`, which then only stages uploads. Credentials come from boto3's chain
    # (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a Kubernetes Secret's env).
    adapter_store_url: str = ""
    # The S3 API's endpoint (MinIO, R2, ...); empty: AWS's, or AWS_ENDPOINT_URL.
    adapter_store_endpoint: str = ""
    max_lora_rank: int = Field(default=64, ge=1)
    max_adapter_bytes: int = Field(default=256 << 20, ge=1)
    # A whole upload request (multipart body); past it: 413, before or while it streams.
    max_upload_bytes: int = Field(default=256 << 20, ge=1)
    # Entries an uploaded archive may hold (READMEs and folders count too).
    max_archive_members: int = Field(default=32, ge=2)
    # Per-tenant adapter storage, for tenants whose quota leaves max_adapters /
    # max_adapter_bytes out: the count of names, and the float32 bytes of all their adapters
    # (one shared blob counts for each tenant naming it). Past either: 403.
    default_max_adapters: int = Field(default=64, ge=0)
    default_max_adapter_storage_bytes: int = Field(default=2 << 30, ge=0)
    # Uploads one tenant may have in flight at once (leased like request slots, with
    # quota_lease_s); past it: 429.
    max_concurrent_uploads: int = Field(default=2, ge=1)
    # Each upload is validated in a child process with these limits (RLIMIT_CPU, RLIMIT_AS);
    # past them: 422 (CPU or wall time, twice the CPU limit) or 413 (memory). The memory
    # limit is the child's whole address space (~150 MB of it is Python and numpy).
    upload_validation_cpu_s: int = Field(default=60, ge=1)
    upload_validation_memory_bytes: int = Field(default=2 << 30, ge=256 << 20)
    # Validation children one gateway runs at once; more uploads wait their turn.
    upload_validations: int = Field(default=2, ge=1)
    # Crash leftovers in the adapter store (staging directories, blobs no name references)
    # are removed at start and every adapter_sweep_interval_s once older than the grace
    # period, which must exceed the longest upload. 0: no periodic sweep.
    adapter_sweep_grace_s: float = Field(default=3600.0, ge=0)
    adapter_sweep_interval_s: float = Field(default=600.0, ge=0)

    # A running request's concurrency slot is leased for this long and renewed every third
    # of it; a gateway that dies stops renewing, and its slots come back after at most this.
    quota_lease_s: float = Field(default=60.0, gt=0)
    # When Redis fails during a quota check: "closed" refuses the request (503), "open" admits
    # it unmetered. Either way it is logged and counted (switchboard_quota_redis_errors_total).
    quota_fail_mode: Literal["closed", "open"] = "closed"

    # How long a gateway trusts an API key it has seen valid without asking Redis again: a
    # key revoked through another gateway replica still works here for up to this long (one
    # revoked through this gateway stops at once). 0: every request asks Redis.
    api_key_cache_s: float = Field(default=2.0, ge=0)

    # Workers heartbeat with this TTL; a record whose heartbeat is older is treated as dead
    # even if its key has not expired yet (a stuck worker still holding its key).
    worker_heartbeat_ttl_s: float = Field(default=10.0, gt=0)
    # How often the live-worker list is read again (in the background while it is younger
    # than twice this): keeps per-request Redis work small.
    worker_cache_s: float = Field(default=1.0, ge=0)
    # Load bound for adapter affinity: a worker is eligible while its load (running + waiting)
    # is at most least_load * factor + slack; above it the adapter spills to the next worker.
    route_load_factor: float = Field(default=1.5, ge=1.0)
    route_load_slack: int = Field(default=4, ge=0)

    # Fair scheduling (gateway/tenancy/weights.py, gateway/fair_queue.py). A tenant's weight is its
    # share of contended workers relative to other tenants': the weight of its tier, a weight
    # of its own, or default_scheduling_tier's. Sent to workers in every GenerateRequest (their
    # scheduler shares each engine the same way) and used by the gateway's own queue.
    scheduling_tiers: dict[str, float] = Field(
        default_factory=lambda: {"free": 1.0, "standard": 2.0, "premium": 4.0}
    )
    default_scheduling_tier: str = "standard"
    # How long a gateway trusts a tenant's weight without reading Redis again (renewed in the
    # background past half of it, like API keys): a change through another replica applies
    # here within this; one through this gateway at once. 0: every request reads it.
    scheduling_cache_s: float = Field(default=2.0, ge=0)
    # Written into a new tenant's quota when it is created (admins change it with the quotas
    # API): without it one tenant's burst could hold every slot of every worker. 0: none.
    default_max_concurrent_requests: int = Field(default=64, ge=0)
    # A worker is saturated once this gateway has this many requests in flight on it; when
    # every worker is, requests wait here in their tenant's queue and are sent in weighted
    # fair order. Twice the engine's max_num_seqs (128): a worker keeps a full batch waiting
    # beside the running one (no idle gap between a sequence ending and the next arriving),
    # and past that a request waits here, where a tenant over its share gets a 429 instead
    # of lengthening every tenant's queue in the engine.
    worker_max_in_flight: int = Field(default=256, ge=1)
    # Requests one tenant may have waiting in this gateway's queue; past it: 429 with
    # Retry-After. 0: no waiting (429 as soon as every worker is saturated).
    tenant_queue_limit: int = Field(default=128, ge=0)
    # The longest a request waits in the queue (the request's own deadline may end it first):
    # past it, 503 queue_timeout with Retry-After.
    queue_timeout_s: float = Field(default=60.0, gt=0)

    # The Batch API (gateway/batch/, docs/batch.md). Files (batch inputs and the outputs made
    # for them) live in the adapter store's backend (its bucket's batch-files/ with the S3
    # store, else `adapter_store`/batch-files); a folder here overrides that.
    batch_file_store: Path | None = None
    # One uploaded file: past it 413. Lines one input file may hold (OpenAI: 50,000).
    max_batch_file_bytes: int = Field(default=200 << 20, ge=1)
    max_batch_lines: int = Field(default=50_000, ge=1)
    # Bytes of files one tenant may keep (inputs and outputs alike); past it: 403.
    batch_storage_bytes_per_tenant: int = Field(default=1 << 30, ge=0)
    # How long a file is kept unless its upload asks for less (OpenAI: 30 days for batch).
    batch_file_retention_s: int = Field(default=30 * 86400, ge=60)
    # Batches this gateway replica drives at once, and lines in flight for each.
    batch_runner_batches: int = Field(default=4, ge=0)
    batch_lines_in_flight: int = Field(default=64, ge=1)
    # A runner's lease on a batch; renewed every third of it. A replica that dies leaves its
    # batches to another replica once the lease runs out.
    batch_lease_s: float = Field(default=15.0, gt=0)
    # How often a runner looks for batches nobody drives.
    batch_poll_s: float = Field(default=1.0, gt=0)
    # completion_window values a batch may ask for ("24h" is OpenAI's only one).
    batch_completion_windows: dict[str, int] = Field(default_factory=lambda: {"24h": 86400})

    @model_validator(mode="after")
    def _check(self) -> GatewaySettings:
        token = self.admin_token.get_secret_value()
        weak = token.lower() in DEFAULT_SECRETS or len(token) < MIN_ADMIN_TOKEN_CHARS
        if weak and not self.dev_mode:
            raise ValueError(
                "SWITCHBOARD_ADMIN_TOKEN is empty, a well-known value or shorter than "
                f"{MIN_ADMIN_TOKEN_CHARS} characters; set a random one (e.g. `python -c "
                '"import secrets; print(secrets.token_urlsafe(32))"`) or set '
                "SWITCHBOARD_DEV_MODE=1 on a development machine"
            )
        if self.docs is None:
            self.docs = self.dev_mode
        if not self.served_model_name:
            self.served_model_name = self.model.name
        check_tiers(self.scheduling_tiers, default=self.default_scheduling_tier)
        if (self.worker_tls_cert is None) != (self.worker_tls_key is None):
            raise ValueError(
                "SWITCHBOARD_WORKER_TLS_CERT and SWITCHBOARD_WORKER_TLS_KEY go together"
            )
        return self

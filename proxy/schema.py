"""The proxy's tables: API keys, model prices, workers, stored responses. Money stays in the ledger."""
from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, CheckConstraint, Column, ForeignKey, Index, Integer, String, Table, Text, false, text

from ledger.limits import IDEMPOTENCY_KEY_CHARS_MAX, REASON_CHARS_MAX
from ledger.schema import BigId, Sha256, UTCDateTime, metadata
from proxy.limits import KEY_PREFIX_CHARS_MAX, NAME_CHARS_MAX, STATE_CHARS_MAX, UNBILLED_REASON_CHARS_MAX, WORKER_URL_CHARS_MAX

# An API key is shown once; only its SHA-256 is kept (the key is 256 random
# bits, so a fast hash is enough: there is nothing to brute-force).
api_keys = Table(
    "api_keys",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("account_id", BigInteger, ForeignKey("accounts.id"), nullable=False),
    Column("key_sha256", Sha256, nullable=False, unique=True),
    Column("key_prefix", String(KEY_PREFIX_CHARS_MAX), nullable=False),  # shown in listings, never enough to use
    Column("name", String(NAME_CHARS_MAX)),
    Column("spend_limit_nano_usd", BigInteger),
    Column("created_at", UTCDateTime, nullable=False),
    Column("revoked_at", UTCDateTime),
)

# Prices per token in whole nano-dollars: a per-million price with up to six
# decimals is exact (DESIGN.md, Money).
model_prices = Table(
    "model_prices",
    metadata,
    Column("model", String(NAME_CHARS_MAX), primary_key=True),
    Column("input_nano_usd_per_token", BigInteger, nullable=False),
    Column("output_nano_usd_per_token", BigInteger, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
)

WORKER_STATES = ("active", "draining", "drained", "suspended")
# What a worker serves: chat and completions, or embeddings. Requests of one
# task are never routed to workers of the other.
WORKER_TASKS = ("chat", "embedding")

workers = Table(
    "workers",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("owner_account_id", BigInteger, ForeignKey("accounts.id"), nullable=False),
    Column("url", String(WORKER_URL_CHARS_MAX), nullable=False),
    Column("model", String(NAME_CHARS_MAX), nullable=False),  # the public name callers use
    Column("engine", String(STATE_CHARS_MAX), nullable=False),
    # Only an operator (drain) or the usage check (suspend) writes state;
    # heartbeats write the health columns below and nothing else.
    Column("state", String(STATE_CHARS_MAX), nullable=False, server_default=text("'active'")),
    Column("context_length", Integer),  # from the worker's /v1/models when it says
    Column("served_model", String(NAME_CHARS_MAX)),  # the name the engine itself answers to
    Column("healthy", Boolean, nullable=False, server_default=text("false")),
    Column("last_heartbeat_at", UTCDateTime),
    Column("drain_requested_at", UTCDateTime),
    Column("drained_at", UTCDateTime),
    Column("usage_strikes", Integer, nullable=False, server_default=text("0")),
    Column("suspended_at", UTCDateTime),
    Column("suspension_reason", String(REASON_CHARS_MAX)),
    # Measured capacity (proxy/capacity.py), written by one replica per period
    # so that every replica weighs workers alike: output tokens/s delivered,
    # at saturation when `capacity_saturated` (else only a floor), and the
    # batch of requests the worker ran then.
    Column("throughput_tokens_per_s", Integer),
    Column("created_at", UTCDateTime, nullable=False),
    Column("task", String(STATE_CHARS_MAX), CheckConstraint("task IN ('chat', 'embedding')", name="ck_workers_task"),
           nullable=False, server_default=text("'chat'")),
    Column("capacity_saturated", Boolean, nullable=False, server_default=false()),
    Column("capacity_requests", Integer),
    Column("capacity_measured_at", UTCDateTime),
    # Output tokens every replica relayed from it, added at each health check:
    # the worker's own counter is believed only this far (proxy/capacity.py).
    Column("relayed_tokens_total", BigInteger, nullable=False, server_default=text("0")),
    # It alone held a recent long prompt: every replica keeps room on it for such prompts until then.
    Column("long_prompts_until", UTCDateTime),
    # The worker's own prefix-cache counters (tokens, since its engine started)
    # as the last healthy probe scraped them; NULL when it does not report them.
    # Shown to its owner; routing does not use them.
    Column("prefix_cache_hits_tokens", BigInteger),
    Column("prefix_cache_queries_tokens", BigInteger),
)

# Usage reports above the proxy's count, kept as the evidence strikes are
# decided on (each is also a `UsageDiscrepancyRecorded` event). A row is
# `pending` until it counts towards a strike (`struck`), and `cleared` once
# the worker is resumed or when it can never count (no strike follows from it).
EVIDENCE_STATES = ("pending", "struck", "cleared")

usage_evidence = Table(
    "usage_evidence",
    metadata,
    Column("request_id", String(IDEMPOTENCY_KEY_CHARS_MAX), primary_key=True),
    Column("worker_id", BigInteger, ForeignKey("workers.id"), nullable=False),
    Column("customer_account_id", BigInteger, nullable=False),
    Column("reason", String(NAME_CHARS_MAX), nullable=False),
    Column("state", String(STATE_CHARS_MAX), nullable=False),
    Column("recorded_at", UTCDateTime, nullable=False),
    Column("ledger_seq", BigInteger, nullable=False),
    CheckConstraint("state IN ('pending', 'struck', 'cleared')", name="ck_usage_evidence_state"),
    Index("ix_usage_evidence_worker", "worker_id", "state", "reason", "recorded_at"),
)

# Each response's input (earlier turns included) and output items, kept so
# that a follow-up naming it (`previous_response_id`) can be sent whole to any
# worker: workers share no state. Only its account may name it.
stored_responses = Table(
    "stored_responses",
    metadata,
    Column("response_id", String(IDEMPOTENCY_KEY_CHARS_MAX), primary_key=True),
    Column("account_id", BigInteger, ForeignKey("accounts.id"), nullable=False),
    Column("model", String(NAME_CHARS_MAX), nullable=False),
    Column("input_items", Text, nullable=False),  # JSON, as forwarded
    Column("output_items", Text, nullable=False),  # JSON, as the caller received them
    Column("created_at", UTCDateTime, nullable=False),
)

# Requests that ended with nothing charged (every worker failed, an empty
# completion, a caller who left before the first token...), for the account's
# activity beside its settled requests (invoices.schema.generations). They move
# no money, so no ledger event records them: the proxy writes them here (proxy/unbilled.py).
UNBILLED_STATUSES = ("failed", "cancelled")

unbilled_generations = Table(
    "unbilled_generations",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),  # the order they were written in: the activity's cursor
    Column("request_id", String(IDEMPOTENCY_KEY_CHARS_MAX), nullable=False, unique=True),
    Column("account_id", BigInteger, nullable=False),
    Column("api_key_id", BigInteger, nullable=False),
    Column("model", String(NAME_CHARS_MAX), nullable=False),
    Column("worker_id", BigInteger),  # the last worker tried, if any
    Column("stream", Boolean, nullable=False),
    Column("ttft_ms", BigInteger),  # a first token came, and then nothing billable
    Column("status", String(STATE_CHARS_MAX), nullable=False),
    Column("reason", String(UNBILLED_REASON_CHARS_MAX), nullable=False),
    Column("completed_at", UTCDateTime, nullable=False),
    CheckConstraint("status IN ('failed', 'cancelled')", name="ck_unbilled_generations_status"),
    Index("ix_unbilled_generations_account", "account_id", "id"),
)

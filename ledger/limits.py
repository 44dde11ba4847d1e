"""Every limit of the money core, named once, with its unit in the name.

A limit that another package also needs (the served hold lifetime, the
group-commit defaults) is imported from here, never written again.
"""
from __future__ import annotations

# Sizes the formats fix
SHA256_BYTES = 32
SHA256_HEX_CHARS = 2 * SHA256_BYTES
INT64_MAX = 2**63 - 1  # BIGINT, and what a token count or a metadata integer may reach

# Amounts (nano-USD): BIGINT holds 9.2e18 nano-USD (9.2 billion USD); one amount is kept far below.
AMOUNT_NANO_USD_MAX = 10**18

# Text, in characters
ACCOUNT_KIND_CHARS_MAX = 16
ACCOUNT_NAME_CHARS_MAX = 200
EMAIL_CHARS_MAX = 320  # RFC 3696's longest address
SYSTEM_CODE_CHARS_MAX = 64
EVENT_TYPE_CHARS_MAX = 64
EVENT_TYPES_CACHED_MAX = 64  # the JSON of each event type, kept for hashing (there are a few dozen)
IDEMPOTENCY_KEY_CHARS_MAX = 200  # also request ids, references' names and metadata names
REASON_CHARS_MAX = 500  # reasons, external references, metadata strings
CONSUMER_NAME_CHARS_MAX = 100
# Names the other packages keep beside the ledger: a model's (the proxy's
# prices and workers, and the read models, from a settlement's metadata), an
# API key's, a usage report's reason.
NAME_CHARS_MAX = 200

# Counts inside one command
META_ENTRIES_MAX = 32
EVIDENCE_REQUEST_IDS_MAX = 100

# Holds
# How long a hold lives without a renewal: every running request renews its hold
# every second, so it bounds only how long credits stay held after a replica
# crashes for good: this plus the sweep interval (app/limits.py) must stay well
# under a minute. It also is how long a replica may fail to reach the database
# before its running requests' holds are settled under them.
# The proxy serves with this default (PARALON_HOLD_TTL_S overrides it).
HOLD_TTL_S_DEFAULT = 30
# A replica's pooled hold (ledger.hold_pool) is placed for this many requests' amounts, whole or not at all.
HOLD_POOL_REQUESTS = 64
# After a pool was refused (the customer's credit or the key's limit falls
# short of a whole one), that customer's requests hold their own amounts this long.
HOLD_POOL_RETRY_S = 2.0
HOLD_TTL_S_MAX = 24 * 3600
HOLDS_EXPIRED_PER_SWEEP_MAX = 1000
REPLICA_ID_CHARS_MAX = 200  # who placed a hold (PARALON_REPLICA_ID)

# Group commit
BATCH_SIZE_MAX_DEFAULT = 1024  # commands in one transaction
BATCH_WAIT_MS_DEFAULT = 1.0  # how long a batch waits for more once its first command arrived
# A batch stops waiting sooner once nothing more arrived for this long: the
# callers that were coming have queued, and waiting on adds only latency.
BATCH_QUIET_MS_DEFAULT = 0.25
HOLD_BATCH_WAIT_MS_DEFAULT = 0.0  # holds are on the path to the first token: never wait for company
QUEUE_DEPTH_MAX_DEFAULT = 50_000  # commands waiting before callers are refused
TRANSIENT_ATTEMPTS_MAX = 3  # tries of one batch that fails for a transient reason
WRITER_CLOSE_WAIT_S = 30.0  # how long closing waits for the queued commands to commit
EVENTS_INSERTED_WITH_COMMIT_MAX = 16  # a durable batch's events sent with its COMMIT; more go by COPY first

# Reading
LOG_PAGE_EVENTS_DEFAULT = 2000
LOG_PAGE_EVENTS_MAX = 10_000
# `ledger verify` walks the log in up to this many processes, one per core, when
# each gets at least this many events (a process takes about a second to start).
VERIFY_PROCESSES_MAX = 8
VERIFY_EVENTS_PER_PROCESS_MIN = 100_000
VERIFY_PROGRESS_POLL_S = 0.2
IN_CLAUSE_VALUES_MAX = 1000  # values in one IN (...) or one array parameter
ACCOUNT_KINDS_CACHED_MAX = 100_000  # account kinds remembered per engine
VERIFY_PROBLEMS_LISTED_MAX = 100  # the rest are counted

# Databases
# A connection attempt gives up after this long: a caller learns the database is
# away in seconds, not in the kernel's minutes (a refused connection fails at
# once). Not shorter: a server that is up but busy (a burst of new backends on
# a loaded machine, a checkpoint's writes) must not be taken for one away.
DATABASE_CONNECT_TIMEOUT_S = 5
# TCP keepalives on every connection: a path that died silently is noticed within
# idle + interval * probes seconds instead of the kernel's two hours.
DATABASE_KEEPALIVE_IDLE_S = 10
DATABASE_KEEPALIVE_INTERVAL_S = 5
DATABASE_KEEPALIVE_PROBES = 3
# Data sent that the server's side has not acknowledged for this long closes the
# connection (a path that drops packets silently), instead of TCP's ~15 minutes of retransmissions.
DATABASE_TCP_USER_TIMEOUT_MS = 15_000
# A group-commit batch whose connection failed is retried on a new one after
# each of these waits (the first at once: a terminated backend is replaced in
# milliseconds); then its callers get DatabaseUnavailable. While the database
# stays away, a batch gets one attempt only, so callers fail fast.
DATABASE_RETRY_WAITS_S = (0.0, 0.1, 0.3)
# psycopg prepares a statement on the server after this many executions: in
# effect never, so that only a statement asked for is (the hold function's
# call); None would let none be, even when asked.
STATEMENT_EXECUTIONS_BEFORE_PREPARED = 2**62
POOL_CONNECTIONS_DEFAULT = 10  # PostgreSQL, per engine, plus as many overflow connections
SQLITE_BUSY_TIMEOUT_MS = 30_000  # how long a writer waits for SQLite's one write lock
MS_PER_S = 1000

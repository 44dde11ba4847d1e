"""Every limit and default of the edge (app/), named once, with its unit in the name.

A limit that a part owns is imported from that part and never written here
again: the hold's lifetime and the group-commit defaults from
`ledger.limits`, the proxy's intervals from `proxy.limits`, the mail's from
`invoices.limits`. Where a setting takes another unit (milliseconds), it is
derived from that one constant. Tests that need a smaller value pass it as a
parameter rather than patch this module."""
from __future__ import annotations

# --- Settings: bounds and defaults of PARALON_* (app/settings.py) ----------------
GROUP_COMMIT_BATCH_COMMANDS_MAX = 10_000  # the largest PARALON_GROUP_COMMIT_BATCH_SIZE_MAX
GROUP_COMMIT_WAIT_MS_MAX = 100  # the largest PARALON_GROUP_COMMIT_WAIT_MS
INTERVAL_MS_MIN = 50  # the shortest health-probe and hold-sweep intervals
HEALTH_INTERVAL_MS_MAX = 60_000
CAPACITY_PERIOD_MS_MAX = 3_600_000  # how rarely a worker's capacity may be measured
KEY_CACHE_TTL_MS_MAX = 60_000  # a revoked key stops working within this long even if its notice is lost
HOLD_TTL_S_MIN = 2  # the shortest hold lifetime a replica serves with
# How often a replica closes the holds crashed replicas left behind: with the
# hold lifetime (ledger.limits.HOLD_TTL_S_DEFAULT) it bounds how long a crash
# for good keeps credits held (30 s + 5 s, under the promised minute).
HOLD_SWEEP_INTERVAL_S = 5.0
HOLD_SWEEP_INTERVAL_MS_MAX = 3_600_000
# A replica restarted after a crash waits this long before it settles the holds
# it finds under its own id: a hold renewed meanwhile belongs to a process still
# running under the same id (two replicas given one PARALON_REPLICA_ID) and is
# left to it. Three renewal intervals (proxy.limits.HOLD_RENEW_INTERVAL_S_MAX).
ORPHANED_HOLDS_WAIT_S = 3.0
CHECKOUT_MIN_USD_DEFAULT = 5
CHECKOUT_MAX_USD_DEFAULT = 10_000
CHECKOUT_USD_MAX = 1_000_000  # the largest either checkout setting may be
CRYPTO_CONFIRMATIONS_DEFAULT = 12
CRYPTO_CONFIRMATIONS_MAX = 10_000
CRYPTO_START_BLOCK_MAX = 10**12
CRYPTO_SCAN_INTERVAL_S_DEFAULT = 15.0
CRYPTO_SCAN_INTERVAL_S_MIN = 0.1  # of `paralon crypto scan --interval-s`
CRYPTO_SCAN_INTERVAL_S_MAX = 3600

# --- Ports ----------------------------------------------------------------------
SERVE_PORT_DEFAULT = 8000
TCP_PORT_MAX = 65535

# --- The HTTP service (app/http/) --------------------------------------------------
# The HTTP client of the health probes (app/http/factory.py). Each probe sets
# its own timeout (proxy.limits.HEALTH_PROBE_TIMEOUT_S); these are the client's.
UPSTREAM_CONNECTIONS_MAX = 1024
UPSTREAM_READ_TIMEOUT_S = 600.0
UPSTREAM_WRITE_TIMEOUT_S = 30.0
UPSTREAM_POOL_TIMEOUT_S = 30.0
# An idle client connection is kept this long: longer than clients keep theirs (httpx and
# the `openai` SDK 5 s, aiohttp 15 s, load balancers 60 s), so that the client, not the
# server, closes it. A server that closes first races a request sent on it at that
# moment, which the client sees as a connection reset (uvicorn's default is 5 s).
HTTP_IDLE_CONNECTION_KEPT_S = 75
# A request catches the read models up at most once; still behind, it answers 503 with Retry-After.
HTTP_CATCH_UP_ROUNDS_MAX = 1
# GET /ready: each check (a SELECT 1, a Redis PING) gets this long before it counts as failed,
# and the read models may be this far behind the log (the age of the oldest event they
# have not applied) before the replica reports itself not ready.
READY_CHECK_TIMEOUT_S = 2.0
READY_READ_MODEL_LAG_S_MAX = 300
# Without an Idempotency-Key header, the same top-up asked for twice within this window is one session.
CHECKOUT_RETRY_WINDOW_S = 60
# GET /v1/invoices.zip is built whole in memory before it is sent (a partial zip is never sent):
# the PDFs of one download come to at most this many bytes; a longer period is asked for in parts.
DOCUMENTS_ZIP_BYTES_MAX = 64 * 1024 * 1024  # about 4,000 invoices of 15 kB
# GET /v1/accounts (admins): accounts per page, unless ?limit= asks for fewer.
ACCOUNTS_PAGE_ROWS_DEFAULT = 100
ACCOUNTS_PAGE_ROWS_MAX = 1_000

# --- Stripe (app/payments/stripe.py, app/payments/schema.py) ------------------------
STRIPE_SIGNATURE_TOLERANCE_S = 300  # a webhook signed longer ago is refused (a replay)
STRIPE_NETWORK_RETRIES_MAX = 2
CHECKOUT_IDEMPOTENCY_DIGEST_CHARS = 40  # of a SHA-256 in hex, in the checkout's idempotency key
STRIPE_ID_CHARS_MAX = 255  # a session's, a payment intent's, an event's, a dispute's id
STRIPE_EVENT_TYPE_CHARS_MAX = 100
STRIPE_OUTCOME_CHARS_MAX = 500  # what processing an event did, kept beside it
DISPUTE_STATUS_CHARS_MAX = 16  # frozen, won, lost
# An event that cannot be processed is parked and tried again after a delay that
# doubles from the base up to the limit; after the last attempt it waits for an operator.
STRIPE_EVENT_ATTEMPTS_MAX = 8
STRIPE_RETRY_BACKOFF_S_BASE = 60
STRIPE_RETRY_BACKOFF_FACTOR = 2  # each failure multiplies the delay by this
STRIPE_RETRY_BACKOFF_S_MAX = 6 * 3600
STRIPE_RETRIES_INTERVAL_S = 60.0  # how often beat looks for parked events now due
STRIPE_ERROR_CHARS_MAX = 500  # why an event is parked, kept beside it
STRIPE_FIELD_SHOWN_CHARS_MAX = 80  # of a malformed field's value, quoted in the error

# --- Stablecoin deposits (app/payments/crypto.py, app/payments/schema.py) ------------
CRYPTO_SCAN_BLOCKS_MAX = 2_000  # blocks one scan reads
CRYPTO_REORG_DEPTH_BLOCKS = 128  # recent block hashes kept to notice a reorganisation
CHAIN_RPC_TIMEOUT_S = 30
EVM_ADDRESS_CHARS = 42  # 0x and 40 hex digits
EVM_HASH_CHARS = 66  # 0x and 64 hex digits
UINT256_DIGITS = 78  # decimal digits of the largest uint256: a raw amount as on chain

# --- Owners' payouts (app/payments/payouts.py, app/payments/schema.py) ---------------
PAYOUT_MIN_USD_DEFAULT = 10  # PARALON_PAYOUT_MIN_USD
PAYOUT_MIN_USD_MAX = 1_000_000
PAYOUT_FEE_USD_DEFAULT = 0  # PARALON_PAYOUT_FEE_USDC_USD, PARALON_PAYOUT_FEE_STRIPE_USD
PAYOUT_DESTINATION_COOLDOWN_S = 24 * 3600  # a changed destination receives nothing before this has passed
PAYOUT_RAIL_CHARS_MAX = 16
PAYOUT_STATE_CHARS_MAX = 16
PAYOUT_DESTINATION_CHARS_MAX = 255  # an EVM address or a Stripe connected account id
PAYOUT_FAILURE_CHARS_MAX = 500
PAYOUTS_LISTED_MAX = 200  # one page of an owner's payouts
PAYOUT_REFERENCES_CHECKED_MAX = 1_000  # payouts of each rail `ledger verify` checks on the rail, newest first
USDC_DECIMALS = 6  # a payout token's decimals when PARALON_PAYOUT_TOKEN does not say
# The Stripe rail (app/payments/payout_stripe.py): requested payouts one run of the sender
# pays (the rest at the next run), and how often beat runs it.
STRIPE_PAYOUTS_PER_RUN_MAX = 100
STRIPE_PAYOUTS_INTERVAL_S = 60.0
# Stripe keeps an idempotency key at least 24 h. A payout requested longer ago than this
# is first looked up by its transfer group, so that a transfer a lost attempt made is
# found rather than made again under a key Stripe may have forgotten.
STRIPE_IDEMPOTENCY_KEY_TRUSTED_S = 20 * 3600
STRIPE_TRANSFERS_LISTED_MAX = 10  # transfers of one group read by that lookup (a payout has one)

# --- The USDC rail's sender (app/payments/payout_chain.py) ---------------------------
PAYOUT_REPLACE_AFTER_S_DEFAULT = 600.0  # PARALON_PAYOUT_REPLACE_AFTER_S: a transfer not mined by then is re-signed at a higher fee
PAYOUT_REPLACE_AFTER_S_MAX = 7 * 24 * 3600
PAYOUT_SEND_INTERVAL_S_DEFAULT = 30.0  # PARALON_PAYOUT_SEND_INTERVAL_S: how often beat (or `payouts send`) runs the sender
PAYOUT_SEND_INTERVAL_S_MIN = 0.1
PAYOUT_SEND_INTERVAL_S_MAX = 3600
PAYOUTS_SIGNED_PER_RUN_MAX = 20  # new payouts one run signs and sends
PAYOUTS_LOOKED_AT_PER_RUN_MAX = 500  # payouts one run looks at in each pass: those with a signed transaction, then those to sign
PAYOUT_REPLACEMENTS_MAX = 8  # re-signings of one nonce at a higher fee (9/8 each: at most about 2.6 times the first fee)
# A replacement pays at least 9/8 of the fee it replaces, on both maxFeePerGas and
# maxPriorityFeePerGas: nodes refuse one under +10 % (geth) or +12.5 % (others).
PAYOUT_FEE_BUMP_NUMERATOR = 9
PAYOUT_FEE_BUMP_DENOMINATOR = 8
PAYOUT_BASE_FEE_MULTIPLIER = 2  # maxFeePerGas = this times the base fee plus the tip: room for six full blocks
PAYOUT_GAS_MARGIN_PERCENT = 25  # above the node's estimate of the transfer's gas

# --- Anchors of the chain's head (app/anchoring/) ------------------------------------
ANCHOR_INTERVAL_S_DEFAULT = 600.0  # how often beat writes the head outside the database
ANCHOR_INTERVAL_S_MIN = 1.0
ANCHOR_RECEIPT_TIMEOUT_S = 120  # how long writing an anchor waits for its transaction to be mined (beat waits too)
ANCHOR_SCAN_BLOCKS_MAX = 10_000  # blocks `ledger verify --chain-from-block` reads for anchors
ANCHOR_FILE_LINE_BYTES_MAX = 1024  # one anchor line; far below what one O_APPEND write keeps whole
ANCHOR_FILE_MODE = 0o644  # readable by whoever ships the file off the host
ANCHOR_SEQ_BYTES = 8  # the seq in an anchor transaction's data, big endian
EVM_RECEIPT_STATUS_SUCCESS = 1  # a mined transaction that did not revert
EVM_DYNAMIC_FEE_TX_TYPE = 2  # EIP-1559: maxFeePerGas and maxPriorityFeePerGas

# --- Jobs (app/outbox.py, app/jobs/) --------------------------------------------------
OUTBOX_DISPATCH_TASKS_MAX = 500  # tasks one dispatch sends
OUTBOX_TASK_NAME_CHARS_MAX = 100
OUTBOX_INTERVAL_S = 5.0  # how often beat sends what a stopped process left in the outbox
# The read models follow the log within READ_MODELS_LAG_S_MAX (issue 13): the applier (a
# `serve` replica's follower, or beat's task where no replica holds the lease) looks for new
# events every READ_MODELS_INTERVAL_S and applies them all, page by page.
READ_MODELS_INTERVAL_S = 1.0
READ_MODELS_LAG_S_MAX = 5.0
# Stopping the follower waits for the page it is applying (one transaction) this long at most.
READ_MODELS_FOLLOWER_STOP_TIMEOUT_S = 30.0
READ_MODELS_FAILURES_TO_YIELD = 30  # failed rounds in a row after which a replica gives up the applier lease
# Each day at 00:30 UTC, after a month's close grace (invoices.limits.CLOSE_GRACE_S).
STATEMENTS_DAILY_AT_HOUR = 0
STATEMENTS_DAILY_AT_MINUTE = 30
# How often beat proves the ledger (PARALON_LEDGER_VERIFY_INTERVAL_S): the chain from the last proven
# event on, and every balance against the sum of its postings (app/jobs/verify.py).
LEDGER_VERIFY_INTERVAL_S_DEFAULT = 300.0
LEDGER_VERIFY_INTERVAL_S_MIN = 1.0
LEDGER_VERIFY_INTERVAL_S_MAX = 86_400.0
EMBEDDED_BEAT_TICK_S = 1.0  # how often the embedded beat looks for due tasks
# Low-balance alerts (app/jobs/low_balance_alerts.py): how often beat looks for customers below
# their threshold, and how many it emails in one run (the rest at the next).
LOW_BALANCE_ALERTS_INTERVAL_S = 60.0
LOW_BALANCE_ALERTS_PER_RUN_MAX = 500

# --- What an owner sees of its workers (app/worker_traffic.py) ------------------------
TRAFFIC_SHARE_WINDOW_S = 24 * 3600  # a worker's share of its model's requests is counted over this long
TRAFFIC_SHARE_DECIMALS = 4  # of the share shown (0.3333)

# --- Summaries of usage and earnings (app/accounts.py) -----------------------------
SUMMARY_WINDOWS_DAYS = (1, 7, 30)  # today, the last week, the last month (today included)
SUMMARY_WINDOW_DAYS_MAX = 30
RATE_WINDOW_DAYS = 7  # the spend rate that says how many days the credits last
GROUP_BY_DIMENSIONS_MAX = 2  # `group_by=day,model`: a chart's x axis and its series

# --- Management tokens (app/tokens.py) ---------------------------------------------
ROLE_CHARS_MAX = 16  # customer, viewer, accountant, owner, admin

# --- The console (app/console/, app/members.py) -------------------------------------
MEMBER_ROLE_CHARS_MAX = 16  # customer_admin, customer_viewer, owner, accountant, platform_admin
SIGN_IN_LINK_TTL_MINUTES = 15  # an emailed sign-in link works once, within this long
SIGN_IN_LINK_TTL_S = SIGN_IN_LINK_TTL_MINUTES * 60
SIGN_IN_WINDOW_S = 15 * 60  # the window the two rate limits below count in
SIGN_IN_LINKS_PER_ADDRESS_MAX = 5  # links mailed to one address per window
SIGN_IN_REQUESTS_PER_IP_MAX = 20  # sign-in requests from one IP address per window
IP_ADDRESS_CHARS_MAX = 45  # the longest textual IPv6 address
SESSION_IDLE_S = 2 * 3600  # a session unused this long is over
SESSION_ABSOLUTE_S = 12 * 3600  # and any session is over this long after sign-in
SESSION_TOUCH_INTERVAL_S = 60  # a page writes its session's last use at most this often
CHECKOUT_NONCE_BYTES = 8  # a console top-up form's own idempotency key
QR_MODULE_PX = 4  # the deposit address's QR code: pixels per module
QR_BORDER_MODULES = 2  # its quiet zone
QR_CODES_CACHED_MAX = 1024  # deposit addresses whose QR code a process keeps drawn (about 2 KB each)
CONSOLE_STATIC_MAX_AGE_S = 300  # browsers reuse the console's scripts and styles this long

# --- An account's activity (app/activity.py) ------------------------------------------
ACTIVITY_ROWS_DEFAULT = 50  # requests in one page
ACTIVITY_ROWS_MAX = 500

# --- `paralon up`: the simulated workers it starts (app/cli/up.py) --------------------
SIM_WORKERS_START_TIMEOUT_S = 60.0  # a loaded laptop (or CI) may take a while to import and bind
SIM_WORKERS_STOP_TIMEOUT_S = 10.0
SIM_WORKER_PROBE_TIMEOUT_S = 1.0  # one /health request while waiting for a worker to answer
SIM_WORKER_PROBE_INTERVAL_S = 0.1

# --- Garbage collection of long-running processes (app/runtime.py) --------------------
# A group-commit batch allocates hundreds of thousands of short-lived objects.
# With CPython's default gen0 threshold (700 allocations) that sets off
# collections all through every batch, and the older generations keep walking
# every long-lived object (SQLAlchemy metadata, statement caches). Freezing
# what start-up built and collecting less often cut the CPU per settlement by
# about a quarter in benchmarks/ledger_throughput.py.
GC_GEN0_THRESHOLD_ALLOCATIONS = 100_000
GC_GEN1_THRESHOLD_COLLECTIONS = 50
GC_GEN2_THRESHOLD_COLLECTIONS = 50

# --- The served API document (app/http/openapi.py) ---------------------------
DOCS_EXAMPLE_MAX_TOKENS = 16  # what the examples ask for: short, so trying one costs little

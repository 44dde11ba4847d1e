"""Every limit of the proxy package, each named once with its unit.

A module that needs one imports it from here; no other module of the package
writes a limit's number. Tests that need a smaller value pass it as a
parameter (a hold's TTL, an idle timeout) rather than patch this module."""
from __future__ import annotations

# What the proxy shares with the ledger and the read models: the hold's
# lifetime it serves with, and how long a name (a model's, a key's) may be.
from ledger.limits import HOLD_TTL_S_DEFAULT, NAME_CHARS_MAX  # noqa: F401

# --- Holds (DESIGN.md, Metering rules) ---------------------------------------
# How often a process renews the holds of its requests still running and
# records what each has delivered, in one statement for all of them.
HOLD_RENEW_INTERVAL_S_MAX = 1.0
# At least this many renewals per TTL, so a renewal can be late without losing a hold.
HOLD_RENEWALS_PER_TTL_MIN = 4
# A replica's pooled hold (PARALON_HOLD_POOLS) that no request used for this long is released:
# what it reserved is the customer's to spend through any replica again.
HOLD_POOL_IDLE_S = 2.0
# How long a hold granted in full lets the next request of the same customer
# start upstream before its own hold is confirmed.
SOLVENT_FOR_S = 30.0

# --- Settlement --------------------------------------------------------------
SETTLE_ATTEMPTS_MAX = 5  # tries of a settlement the group-commit writer refused as overloaded
SETTLE_RETRY_WAIT_S = 0.05  # times the attempt number
# A delivered stream whose settlement met the database away is settled again
# this often until it succeeds, for at most this long (then the sweeper settles
# its hold at the usage it recorded).
SETTLE_OUTAGE_RETRY_INTERVAL_S = 0.5
SETTLE_OUTAGE_RETRY_S_MAX = 600.0
SHUTDOWN_DATABASE_WAIT_S = 5.0  # at shutdown, how long those retries may still wait for the database

# --- Requests ----------------------------------------------------------------
UPSTREAM_ATTEMPTS_MAX = 3  # workers tried before the first token
# max_tokens when the caller set none and no candidate has told its context length yet
MAX_TOKENS_WITHOUT_CONTEXT = 4096
MAX_TOKENS_LIMIT = 1_000_000  # the largest max_tokens a caller may ask for
# Choices per prompt (`n`), prompts in one /v1/completions list, and choices in
# all: each is held for at max_tokens and relayed, so the hold grows with them.
CHOICES_PER_PROMPT_MAX = 16
PROMPTS_PER_REQUEST_MAX = 64
CHOICES_PER_REQUEST_MAX = 128
UPSTREAM_REFUSAL_DETAIL_BYTES_MAX = 2000  # of a worker's 400 body, shown to the caller
NOT_READY_RETRY_AFTER_S = 5  # a read model is catching up: ask again after this long
DATABASE_RETRY_AFTER_S = 1  # the database is away: every answer is a 503 that says to ask again after this long
HOLDS_BUSY_RETRY_AFTER_S = 1  # the holds' queue is full: it drains in a few batches
NO_WORKER_RETRY_AFTER_S = 2  # no worker could take the request: health probes may bring one back by then
# llama.cpp streams no usage: the one-token request asking for the prompt's count.
USAGE_PROBE_TIMEOUT_S = 30.0
# Requests that ended with nothing charged, kept for the account's activity
# (proxy/unbilled.py): written in one statement this often; at most this many
# wait in memory (beyond, while the database is away, the newest are dropped).
UNBILLED_FLUSH_INTERVAL_S = 1.0
UNBILLED_PENDING_MAX = 10_000
UNBILLED_REASON_CHARS_MAX = 32  # why nothing was charged: a word of the code
# The PostgreSQL advisory lock each write of them takes (transaction-level), so
# they commit in the order of their ids. The bytes of "par:unbl".
UNBILLED_WRITE_LOCK_KEY = 0x7061723A756E626C

# --- Request bodies: the ranges of OpenAI's API document (proxy/request_checks.py)
OPENAI_TEMPERATURE_MAX = 2
OPENAI_PENALTY_MAX = 2  # frequency_penalty, presence_penalty: from minus this to this
OPENAI_TOP_LOGPROBS_MAX = 20  # chat's top_logprobs
OPENAI_COMPLETION_LOGPROBS_MAX = 5  # /v1/completions' logprobs
OPENAI_BEST_OF_MAX = 20
OPENAI_CHOICES_MAX = 128  # n
OPENAI_LOGIT_BIAS_MAX = 100  # each bias, from minus this to this
OPENAI_SEED_MIN = -(2 ** 63)  # a signed 64-bit integer
OPENAI_SEED_MAX = 2 ** 63 - 1
SIM_TOOL_CALL_ID_HEX_CHARS = 24  # the simulated worker's call_ ids, as long as OpenAI's

# --- The connections to workers (proxy/upstream.py) ----------------------------
UPSTREAM_CONNECT_TIMEOUT_S = 5.0
UPSTREAM_IDLE_TIMEOUT_S = 300.0  # a worker silent this long mid-response is abandoned
UPSTREAM_IDLE_CONNECTIONS_PER_WORKER_MAX = 256
UPSTREAM_READ_PAUSE_BYTES = 1024 * 1024  # stop reading from a worker whose caller is this far behind
UPSTREAM_READ_RESUME_BYTES = UPSTREAM_READ_PAUSE_BYTES // 2  # and read again once it caught up this far
SSE_EVENT_BYTES_MAX = 4 * 1024 * 1024  # one upstream event, buffered until it is complete

# --- Health checks (proxy/health.py) ------------------------------------------
HEALTH_INTERVAL_S = 2.0
HEALTH_PROBE_TIMEOUT_S = 2.0
# A healthy worker too busy to answer in time is not down: it is unhealthy
# after this many probes in a row timed out (refused or failing: at once).
HEALTH_TIMEOUTS_IN_A_ROW_MAX = 2
DRAIN_DEADLINE_S = 120  # a draining worker counts as drained after this long
PREFIX_CACHE_HIT_RATE_DECIMALS = 4  # of the hit rate shown to a worker's owner (0.8125)

# --- Capacity: what each worker delivers, agreed by every replica (proxy/capacity.py)
# One replica per period writes a worker's capacity, from the worker's own
# counters over the period (every replica scrapes the same counters).
CAPACITY_PERIOD_S = 10.0
CAPACITY_WINDOW_PERCENT_MIN = 50  # scrapes must span this much of a period before it is measured
# A period is a measurement at saturation when the worker queued requests at
# both ends of intervals covering at least this share of it.
CAPACITY_SATURATED_PERCENT_MIN = 50
# Each saturated measurement moves the capacity this far towards itself: one
# odd period does not swing the weights, a lasting change shows in a few.
CAPACITY_SMOOTHING_PERCENT = 50
# A worker's own count of its output is believed up to this much above what
# the replicas relayed from it (tokens it generated for callers who left, and
# relayed tokens booked a little later than generated).
RELAYED_TOKENS_MARGIN_PERCENT = 50
SCRAPES_KEPT_MAX = 256  # per worker; a period at the fastest health interval fits

# --- What the hot path reads from memory (proxy/directory.py) ------------------
DIRECTORY_REFRESH_INTERVAL_S = 1.0
KEY_CACHE_TTL_S = 1.0  # the fallback for a revocation notice that never came
KEY_CACHE_ENTRIES_MAX = 100_000

# --- Routing (proxy/routing.py) -----------------------------------------------
# The batch of a worker measured only below saturation, for sharing the load
# when every worker is full: its capacity over this rate per request.
TOKENS_PER_S_PER_REQUEST_MIN = 20
# A measured batch is believed up to the requests that would each decode at
# this rate (an H200 at 3,300 tok/s: 660, above its 256; a pair of RTX 4090s: 87).
BATCH_TOKENS_PER_S_PER_REQUEST_MIN = 5
# The probe weight of a fleet with nothing measured yet, about a mid-range
# card's total: a worker is then sent up to 1,000 / BATCH_TOKENS_PER_S_PER_REQUEST_MIN
# requests (scaled by its KV cache) before it counts as full without a queue.
PROBE_WEIGHT_TOKENS_PER_S = 1000
# A prompt this long is placed by free KV cache, not by decode capacity.
LONG_PROMPT_TOKENS_MIN = 16_384
# The KV cache a worker reports is believed up to this many of its contexts
# (an H200 serving 262,144 tokens holds about 5.7 of them, an RTX 4090 pair 2.3).
KV_CACHE_CONTEXTS_MAX = 8
# Workers that alone held a long prompt keep this share of their batch free
# of short traffic for this long after it, so long prompts do not queue behind chats.
LONG_PROMPT_RESERVE_PERCENT = 25
LONG_PROMPT_RESERVE_S = 60.0
LONG_PROMPT_RESERVE_RENEW_S = 30.0  # written again for the other replicas once less than this is left
AFFINITY_PREFIX_BYTES_MAX = 16_384  # of a conversation, hashed for affinity
AFFINITY_PROMPT_HEAD_BYTES = 1024  # of a completion prompt: what a continued prompt shares
AFFINITY_KEY_BYTES = 16  # the BLAKE2b digest of that prefix
WORKER_ID_BYTES = 8  # a worker's id (a BIGINT), hashed with the affinity key
RENDEZVOUS_HASH_BYTES = 8  # the BLAKE2b digest of (affinity key, worker id), an unsigned integer h
RENDEZVOUS_HASH_SPAN = 2 ** (8 * RENDEZVOUS_HASH_BYTES) + 2  # (h + 1) / span is strictly between 0 and 1
# Measured throughput is rounded to steps of this ratio (about 19%), so that
# replicas that measured slightly differently still agree on weights.
THROUGHPUT_STEP_RATIO = 2**0.25

# --- Workers' rows (proxy/schema.py) -------------------------------------------
WORKER_URL_CHARS_MAX = 2000
STATE_CHARS_MAX = 16  # a worker's engine and state, a usage report's state: words of the code

# --- Usage strikes (proxy/workers.py) ------------------------------------------
USAGE_STRIKES_MAX = 3  # strikes that suspend a worker
# A report above the prompt bound may be the caller's doing: it is a strike
# only once requests of this many different accounts show it within the window.
PROMPT_INFLATION_ACCOUNTS_MIN = 3
PROMPT_INFLATION_WINDOW_S = 3600

# --- Metering: the prompt bound (proxy/metering.py) -----------------------------
# The chat template's own tokens (ChatML-, Llama- and Hermes-style templates
# measured with a byte-level tokenizer, tests/proxy/test_prompt_bound.py).
TEMPLATE_TOKENS_PER_REQUEST = 32  # BOS, the generation prompt
TEMPLATE_TOKENS_PER_MESSAGE = 8  # turn markers around role and content (the role's bytes are counted)
TEMPLATE_TOKENS_PER_TOOL_REPLY = 48  # <tool_response> markup, a turn of its own in some templates
TEMPLATE_TOKENS_PER_TOOL_CALL = 64  # <tool_call>{"name": ..., "arguments": ...}</tool_call>
TEMPLATE_TOKENS_PER_REASONING = 24  # <think>...</think> around reasoning sent back
TEMPLATE_TOKENS_PER_CONTENT_PART = 2  # the separator an engine joins text parts with
TEMPLATE_TOKENS_WITH_TOOLS = 512  # the tools preamble ("You may call one or more functions...")
TEMPLATE_TOKENS_PER_TOOL = 8  # the line around each tool definition
TEMPLATE_TOKENS_WITH_TOKEN_IDS = 2  # BOS (and EOS) an engine may add around token ids it did not tokenise
# A template's `tojson` may indent by up to four spaces: at most this many times what indenting by two adds.
TEMPLATE_JSON_INDENT_RATIO_MAX = 2

# --- Long prompts: the engine's own count (proxy/tokenize.py) -------------------
# A prompt whose byte bound does not fit every worker of its model is counted
# by a worker's /tokenize; the count plus this margin (the larger of the two)
# is the bound routing, the hold and the prompt's billing use, never above the
# byte bound. It covers a special token an engine adds outside its template.
COUNTED_PROMPT_MARGIN_TOKENS_MIN = 16
COUNTED_PROMPT_MARGIN_PERCENT = 1
TOKENIZE_TIMEOUT_S = 10.0  # one count; past it the byte bound routes, as without a count
TOKENIZE_WORKERS_ASKED_MAX = 2  # workers asked for one count before giving up on it
TOKENIZE_CACHE_ENTRIES_MAX = 1024  # recent counts kept, so a retried agent prompt is counted once
TOKENIZE_KEY_BYTES = 16  # the BLAKE2b digest of a prompt, the cache's key

# --- Metering: the completion bound ---------------------------------------------
# Tokens an engine produces but never relays as text.
COMPLETION_ALLOWANCE_TOKENS_PER_FINISH = 8  # stop token(s), <think></think> a reasoning parser strips
COMPLETION_ALLOWANCE_TOKENS_PER_TOOL_CALL = 24  # tool-call markup a tool parser strips
# Far more parallel calls than any agent framework makes; each beyond it is dropped, never relayed.
TOOL_CALLS_PER_ANSWER_MAX = 64
RESPONSE_OUTPUT_ITEMS_MAX = 128  # output items of one Responses answer (messages, reasoning, function calls)
# A completion reported above the bound by more than this is a discrepancy.
COMPLETION_TOLERANCE_TOKENS_MIN = 2
COMPLETION_TOLERANCE_PERCENT = 5

# --- API keys and prices -------------------------------------------------------
KEY_RANDOM_BYTES = 32
KEY_PREFIX_SHOWN_CHARS = 12  # of a key (or a management token), in listings; never enough to use
KEY_PREFIX_CHARS_MAX = 16  # the column the shown prefix is kept in
TOKENS_PER_MTOK = 1_000_000  # prices are quoted per million tokens
PRICE_DECIMALS_MAX = 6  # of a price in USD per million tokens
PRICE_USD_PER_MTOK_MAX = 10_000

# --- Revocations (proxy/revocations.py) ----------------------------------------
REVOCATION_RECONNECT_WAIT_S_MIN = 0.1
REVOCATION_RECONNECT_WAIT_S_MAX = 5.0
REVOCATION_RECONNECT_BACKOFF_FACTOR = 2  # each failed reconnection waits this many times longer
# A listening connection silent this long is asked whether it is still there,
# so a connection dropped without a word is noticed within about this time.
REVOCATION_LIVENESS_CHECK_INTERVAL_S = 5.0
REVOCATION_CONNECT_TIMEOUT_S = 5

# --- The simulated worker (proxy/sim/) ------------------------------------------
SIM_REQUEST_BODY_BYTES_MAX = 32 * 1024 * 1024
SIM_MAX_TOKENS_DEFAULT = 16  # vLLM's default when a request sets none
# 64 bytes is about 16 tokens, vLLM's KV block size: only whole blocks are cached.
SIM_PREFIX_BLOCK_BYTES = 64
SIM_KV_BLOCK_TOKENS = 16
SIM_PREFIX_CACHE_BLOCKS_MAX = 65_536
# Unpaced streams would otherwise never give the event loop back while writing.
SIM_INSTANT_YIELD_EVERY_TOKENS = 8
# Its prompt model: bytes per token, and the template's tokens per message.
SIM_PROMPT_BYTES_PER_TOKEN = 4
SIM_PROMPT_TOKENS_PER_MESSAGE = 4
SIM_WORD_STEP = 37  # coprime with the simulated text's 61 words (proxy/sim/engine.py), so it visits every word
WITHHELD_JOURNAL_ENTRIES_MAX = 100_000  # withheld answers one replica's journal keeps before it refuses more
WITHHELD_JOURNAL_LINE_BYTES_MAX = 512  # one journal line; a request id is far shorter
WITHHELD_JOURNAL_FILE_MODE = 0o600  # only the proxy reads what it owes

# --- Embeddings (proxy/embeddings.py, proxy/sim/embeddings.py) -------------------
EMBEDDING_INPUTS_MAX = 2048  # inputs of one request, as OpenAI's API allows
EMBEDDING_DIMENSIONS_MAX = 65_536  # a `dimensions` asked for; larger than any model's vectors
# Tokens an engine adds around each input it tokenises (BOS/CLS, EOS/SEP, a
# SentencePiece dummy-prefix space); token ids are embedded as they are sent.
EMBEDDING_TOKENS_PER_INPUT = 4
EMBEDDING_ANSWER_BYTES_MAX = 256 * 1024 * 1024  # a worker's answer (2,048 vectors of 4,096 floats as JSON fit)
SIM_EMBEDDING_DIMENSIONS = 16  # the simulated worker's vectors, unless a request asks for fewer
SIM_EMBEDDING_TOKENS_PER_INPUT = 2  # CLS and SEP, as a BERT-style embedding model adds

# --- Request ids (proxy/request_ids.py) -------------------------------------------
REQUEST_ID_RANDOM_BYTES = 10  # 80 bits after the millisecond: two ids of one millisecond collide with odds of 2**-80
REQUEST_IDS_PER_RANDOM_READ = 256  # ids served by one os.urandom call (a system call that lets other threads run)
NS_PER_MS = 1_000_000

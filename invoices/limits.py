"""Every limit of the invoices package, named once, with its unit in the name.

A module that needs one imports it from here; a limit the ledger owns (the
width of an event type, a reason or an external reference) is imported from
`ledger.limits`. Tests that need a smaller value pass it as a parameter
rather than patch this module."""
from __future__ import annotations

from ledger.limits import REASON_CHARS_MAX

# --- Documents: numbers, rows and files (numbering.py, service.py, schema.py) ---
DOCUMENT_SEQUENCE_DIGITS = 6  # PAR-2026-000001
DOCUMENT_NUMBER_CHARS_MAX = 32
SERIES_CHARS_MAX = 16  # PAR, PARCN
DOCUMENT_KIND_CHARS_MAX = 16  # invoice, credit_note
PAYMENT_METHOD_CHARS_MAX = 16  # card, crypto
PDF_PATH_CHARS_MAX = 1000
# Tries to number a document while other transactions take the year's first number, or this top-up's.
NUMBER_ASSIGN_ATTEMPTS_MAX = 5
STATEMENT_FILE_DIGEST_CHARS = 12  # of the PDF's SHA-256, in hex, in the statement's file name
INVOICE_FILE_DIGEST_CHARS = 16  # of the PDF's SHA-256, in hex, in the invoice's file name
DEPLOYMENT_ID_CHARS = 36  # a UUID in text
# The modification time (Unix seconds) written into the fonts a PDF embeds: fixed, so renders repeat byte for byte.
PDF_FONT_TIMESTAMP_S = 0
# A payment reference up to this long fits beside its label even in the widest
# glyphs, so it is set as it always was (the same bytes as before); a longer one
# (a chain's transaction hash with its log index) may break anywhere.
REFERENCE_CHARS_UNBROKEN_MAX = 32

# --- Dates as the read models and statements keep them (UTC) ---
DAY_CHARS = len("YYYY-MM-DD")
MONTH_CHARS = len("YYYY-MM")
MONTHS_PER_YEAR = 12
# The years a statement may be asked for.
STATEMENT_YEAR_MIN = 2000
STATEMENT_YEAR_MAX = 9998

# --- Read models (read_models.py, statements.py, exports.py) ---
PAGES_PER_RUN_MAX = 100  # pages of the ledger log one catch-up applies
# A posting's reference: a request id, a payment's reference or a reason, as the
# ledger bounds them; a reversal's words around one are cut to this.
REFERENCE_CHARS_MAX = REASON_CHARS_MAX
# Catch-up runs a statement or an export waits for before it reads the read models.
CATCH_UP_ROUNDS_MAX = 20
EXPORT_PAGE_ROWS = 5_000  # rows of a CSV export read at once
GENERATION_STATUS_CHARS_MAX = 16  # streamed, completed, cancelled
# The key of the PostgreSQL advisory lock that the one applier of the read models holds
# (session-level: it goes with the applier's connection). The bytes of "par:rmdl".
READ_MODELS_APPLIER_LOCK_KEY = 0x7061723A726D646C

# --- Statements (statements.py) ---
# A month is closed, and its statements kept, this long after it ends: a grace
# for the clocks of other replicas.
CLOSE_GRACE_S = 300
ITEMISED_LINES_MAX = 5_000  # beyond this a statement points to the ledger export

# --- Mail (mail.py) ---
SMTP_PORT_DEFAULT = 25
SMTP_TIMEOUT_S = 30
# A sender that claimed an invoice and went silent this long is presumed dead: another may send it.
MAIL_CLAIM_TIMEOUT_S = 300

# --- Task retries (tasks.py) ---
MAIL_RETRY_WAIT_S = 5
MAIL_RETRIES_MAX = 10_000  # keep trying while the mail server is down
STATEMENT_RETRY_WAIT_S = 60
STATEMENT_RETRIES_MAX = 60

"""Durable appends: a batch of commands in one transaction, each with its own result.

Every append locks `ledger_head` first. That one lock serialises the hash chain,
makes commit order equal sequence order (so a consumer reading by sequence can
never skip a late commit), and guards every balance row, which only appends
write. Holds are never locked here except the ones being settled.
"""
from __future__ import annotations

import weakref
from functools import partial
from typing import NamedTuple

from sqlalchemy import Connection, Engine, select, update
from sqlalchemy.exc import IntegrityError

from ledger import accounts as acc
from ledger import commands as cmd
from ledger import events as ev
from ledger.commands import CREATED, EXISTS
from ledger.db import CHAINED, LOCK_TAKEN, WRITTEN, mark_append, storage_of
from ledger.errors import (
    HoldNotActive,
    IdempotencyConflict,
    InvalidInput,
    InvariantBroken,
    LedgerError,
    NotReversible,
    UnknownAccount,
    UnknownEvent,
)
from ledger.limits import ACCOUNT_KINDS_CACHED_MAX
from ledger.schema import accounts, holds, ledger_event_postings, ledger_events, ledger_head, utc_now
from ledger.settlement_texts import SettleTexts, settle_texts, settled_texts
from ledger.storage.base import LOOK_UP_EVERY_KEY, POSTINGS_IN_EVENT_ROW_SEEN, AppendedBatch, ClosedHold, KnownKeys, in_chunks


class AppendResult(NamedTuple):
    status: str  # "created" or "exists": a retry with the same key is safe
    seq: int
    event_type: str


_append_result_of = partial(tuple.__new__, AppendResult)  # from a 3-tuple, as ev.posting_of: one per event appended


class _BatchBook:
    """The state a batch decides against; later commands see earlier ones' effects."""

    def __init__(self) -> None:
        self.kinds: dict[int, str] = {}
        self.balances: dict[int, int] = {}
        self.held_by_account: dict[int, int] = {}
        self.holds: dict[int, cmd.HoldView] = {}
        self.closing: dict[int, ClosedHold] = {}  # holds this batch closed, until their settlement is written
        # Holds this batch took from for captures that are not final: what was taken, and what is not yet written.
        self.taken: dict[int, list] = {}  # hold id: [ClosedHold of the amount taken, amount not yet written]
        self.closed_finally_too: set[int] = set()  # holds both captured finally and not in this batch: only the final one counts
        self.events: dict[int, tuple[str, list[ev.Posting]]] = {}
        self.reversals: dict[int, int] = {}
        self.system: dict[str, int] = {}
        self.others = False  # whether the batch holds any command but settlements

    def kind(self, account_id: int) -> str:
        try:
            return self.kinds[account_id]
        except KeyError:
            raise UnknownAccount(f"account {account_id} does not exist") from None

    def balance(self, account_id: int) -> int:
        return self.balances[account_id]

    def held(self, account_id: int) -> int:
        try:
            return self.held_by_account[account_id]
        except KeyError:
            raise InvariantBroken(f"holds of account {account_id} were not locked for this batch") from None

    def hold(self, hold_id: int) -> cmd.HoldView:
        try:
            return self.holds[hold_id]
        except KeyError:
            raise HoldNotActive(f"hold {hold_id} is not active: settled, released, expired, never placed, "
                                "or with less left than this batch's captures from it") from None

    def event_postings(self, seq: int) -> tuple[str, list[ev.Posting]]:
        try:
            return self.events[seq]
        except KeyError:
            raise UnknownEvent(f"event {seq} does not exist") from None

    def reversal_of(self, seq: int) -> int | None:
        return self.reversals.get(seq)

    def system_account(self, code: str) -> int:
        try:
            return self.system[code]
        except KeyError:
            raise InvariantBroken(f"system account {code!r} is missing: run `paralon migrate`") from None


def append_batch(conn: Connection, commands: list[cmd.Command], *,
                 closing_keys_to_the_index: bool = False) -> list[AppendResult | LedgerError]:
    """Decide and write `commands` in the caller's transaction; one result per command.

    A command that fails (overdraft, conflict, bad input) gets its error and
    writes nothing; the others in the batch are unaffected.

    `closing_keys_to_the_index` is for a group-commit writer, which runs a
    batch again when the database refuses it: the key of a settlement that
    closed or took from its hold is then not looked up at all, and the
    log's unique index refuses such a key instead. A closed hold shows the
    settlement was not appended before, and any other event with its key is
    a caller's mistake; a capture that is not final is the proxy's own
    (its key is made from its request id), sent again only when its answer
    was lost. The batch that follows on the connection then looks up every
    key, under the lock: the retry gets its `exists`, a mistake its
    `IdempotencyConflict`, and what their holds gave is given back.

    Work is split around the append lock so that the lock, which every
    durable append in every process waits for, is held as briefly as possible:
    before it, everything that does not depend on balances or on the chain
    (hold rows locked and closed, accounts and reversed events loaded, rules
    checked, payloads serialised, the hashed text and the rows' columns
    encoded but for sequence and hashes); under it, balances, the hash chain
    and the inserts. The lock's time per settlement bounds how many settle
    per second, whatever the cores."""
    results: list[AppendResult | LedgerError | None] = [None] * len(commands)
    texts, digests = _texts_and_digests(commands)
    book = _load_book(conn, commands)
    # A settlement that just closed its hold cannot have been appended before,
    # and a capture that took from its hold is the proxy's own, sent again
    # only when its answer was lost: only the others are looked up now.
    to_the_index = _keys_to_the_index(commands, book)
    answered = _known_keys(conn, [(i, c, digests[i]) for i, c in enumerate(commands) if i not in to_the_index])
    for i, result in answered.items():
        results[i] = result
    pending = [i for i in range(len(commands)) if i not in answered]
    prepared, same_batch = _prepare(commands, digests, texts, pending, book, results)

    every_key = not closing_keys_to_the_index or conn.info.pop(LOOK_UP_EVERY_KEY, False)
    keyed = [(i, commands[i], digests[i]) for i in prepared if every_key or i not in to_the_index]
    storage = storage_of(conn)
    drafts = list(prepared.values())
    unchained = storage.encode_unchained([d.columns for d in drafts], [d.postings for d in drafts],
                                         in_event_row=conn.info.get(POSTINGS_IN_EVENT_ROW_SEEN, False))
    head_seq, head_hash, in_event_row, late, holds_closed = _lock_and_read(conn, book, keyed, drafts)
    if book.others:  # a batch of settlements alone reverses nothing
        reversed_seqs = {commands[i].seq for i in prepared if isinstance(commands[i], cmd.ReverseEvent)}
        if reversed_seqs:
            _load_reversals(conn, book, sorted(reversed_seqs))

    seq, prev_hex = head_seq, head_hash.hex()
    recorded_at = utc_now()
    at_text = ev.format_time(recorded_at)
    # What is written, as decided: rows are built from these only by a storage that writes rows.
    events, event_postings, hashes, hashes_hex, written = [], [], [head_hash], [prev_hex], []
    limit_usage: dict[int, tuple[int, int]] = {}  # spend limit: (spent, hold amounts closed)
    touched: set[int] = set()
    # Under the lock: each lookup saved counts twice.
    balances, closing, chained_hash, settled = book.balances, book.closing, ev.chained_hash, ev.RequestSettled
    for drafted_at, (i, (event, postings, columns, hashed)) in enumerate(prepared.items()):
        if type(event) is settled:  # most of any batch: its rules and rows without a loop over its legs
            answer = late.get(i) or cmd.settlement_shortfall(balances[event.customer_account_id], event)
            if answer is not None:  # its hold stays open: not closed after all
                _take_hold_closed(holds_closed, event)
        else:
            answer = late.get(i) or _refusal(book, event, postings)
        if answer is not None:
            results[i] = answer
            continue
        seq += 1
        event_hash = chained_hash(prev_hex, seq, at_text, hashed)
        prev_hex = event_hash.hex()
        hashes.append(event_hash)
        hashes_hex.append(prev_hex)
        written.append(drafted_at)
        events.append(columns)
        event_postings.append(postings)
        if type(event) is settled:
            (customer, debit), (owner, owner_share), (platform, platform_share) = postings
            balances[customer] += debit
            balances[owner] += owner_share
            balances[platform] += platform_share
            touched.update((customer, owner, platform))
            hold = closing.pop(event.hold_id, None) or _written_from_taken(book.taken, event)
            if hold.spend_limit_id is not None:
                spent, closed = limit_usage.get(hold.spend_limit_id, (0, 0))
                limit_usage[hold.spend_limit_id] = (spent + event.charge_nano_usd,
                                                    closed + event.charge_nano_usd + event.released_nano_usd)
        else:
            for account_id, amount in postings:
                balances[account_id] += amount
                touched.add(account_id)
            if isinstance(event, ev.EventReversed):
                book.reversals[event.reversed_seq] = seq
        results[i] = _append_result_of((CREATED, seq, columns[0]))

    mark_append(conn, CHAINED)
    storage.reopen_holds(conn, [book.closing[h] for h in sorted(book.closing)])  # closed for a command that then failed
    storage.give_back_to_holds(conn, {h: left for h, (_, left) in book.taken.items() if left})  # taken for one
    if events:
        try:
            storage.write_appended(conn, AppendedBatch(events, event_postings, hashes, {a: balances[a] for a in touched},
                                                       holds_closed, limit_usage, seq, recorded_at,
                                                       None if unchained is None else [unchained[k] for k in written], hashes_hex,
                                                       in_event_row))
        except IntegrityError:
            if closing_keys_to_the_index:
                conn.info[LOOK_UP_EVERY_KEY] = True
            raise
        mark_append(conn, WRITTEN)
    for i, first in same_batch.items():
        results[i] = _repeat_of(results[first], commands[i], digests[i] == digests[first])
    if None in results:
        raise InvariantBroken("a command in the batch got no result")
    return results  # type: ignore[return-value]


def append_one(conn: Connection, command: cmd.Command) -> AppendResult:
    """One command in the caller's transaction: its result, or its typed error raised."""
    [result] = append_batch(conn, [command])
    if isinstance(result, LedgerError):
        raise result
    return result


def _keys_to_the_index(commands: list[cmd.Command], book: _BatchBook) -> set[int]:
    """The indexes of the settlements whose holds this batch closed (final
    captures) or took from (captures that are not final): their keys are
    left to the log's unique index."""
    closing, taken, settle_type = book.closing, book.taken, cmd.SettleRequest
    return {i for i, c in enumerate(commands)
            if isinstance(c, settle_type) and c.hold_id in (closing if c.final_capture else taken)}


def _refusal(book: _BatchBook, event: object, postings: list[ev.Posting]) -> LedgerError | None:
    """The rules that read balances, checked under the append lock."""
    if isinstance(event, ev.EventReversed) and (by := book.reversal_of(event.reversed_seq)) is not None:
        return NotReversible(f"event {event.reversed_seq} was already reversed by event {by}")
    try:
        cmd.require_covered(book, event, postings)
    except LedgerError as exc:
        return exc
    return None


class _Draft(NamedTuple):
    """A command's event as decided before the append lock: all of it but what the lock decides."""

    event: object
    postings: list[ev.Posting]
    columns: tuple  # EVENT_COLUMNS from event_type to reverses_seq: all but the chained ones
    hashed: tuple[str, str]  # ev.hashed_parts


_draft_of = partial(tuple.__new__, _Draft)  # from a 4-tuple, as ev.posting_of: one per command
_SETTLED = ev.RequestSettled.__name__


def _prepare(commands, digests, texts, pending, book, results):
    """Rules that read no balance, for each command not yet answered.

    Returns {index: _Draft} in command order, and {index: index of the first
    command} for keys repeated inside the batch."""
    prepared: dict[int, _Draft] = {}
    first_by_key: dict[str, int] = {}
    same_batch: dict[int, int] = {}
    holds, hold_view_of, prepare_settlement = book.holds, cmd.hold_view_of, cmd.prepare_settlement
    taken, closed_finally = book.taken, book.closed_finally_too
    for i in pending:
        command, settle = commands[i], texts[i]
        key = command.idempotency_key
        if key in first_by_key:
            same_batch[i] = first_by_key[key]
            continue
        first_by_key[key] = i
        if closed_finally and settle is not None and command.hold_id in closed_finally and not command.final_capture:
            results[i] = HoldNotActive(f"hold {command.hold_id} is captured finally in the same batch")
            continue
        try:
            event, postings = cmd.prepare(command, book) if settle is None else prepare_settlement(command, book)
        except LedgerError as exc:
            results[i] = exc
            continue
        if settle is None:
            prepared[i] = _draft(event, postings, key, digests[i])
            if not isinstance(event, ev.RequestSettled):
                continue
        else:
            payload_json, hashed = settled_texts(event, postings, settle)
            prepared[i] = _draft_of((event, postings, (_SETTLED, payload_json, key, settle.digest, None), hashed))
        hold = holds[event.hold_id]  # a second settlement of it in this batch must fail, unless it only took its charge
        if event.hold_id in taken:  # a capture that is not final: the next may take from what this one left
            holds[event.hold_id] = hold_view_of((hold.hold_id, hold.account_id, hold.amount_nano_usd - event.charge_nano_usd, True))
        else:
            holds[event.hold_id] = hold_view_of((hold.hold_id, hold.account_id, hold.amount_nano_usd, False))
    return prepared, same_batch


def _texts_and_digests(commands: list[cmd.Command]) -> tuple[list[SettleTexts | None], list[bytes]]:
    """Each command's content digest, and a settlement's texts, written directly, where it can have them."""
    texts = [settle_texts(c) if type(c) is cmd.SettleRequest else None for c in commands]
    return texts, [cmd.command_digest(c) if t is None else t.digest for c, t in zip(commands, texts)]


def _draft(event: object, postings: list[ev.Posting], key: str, digest: bytes) -> _Draft:
    """Any event's, through its fields (a settlement's texts are written directly: ledger.settlement_texts)."""
    event_type = type(event).__name__
    payload_json = ev.canonical_json(ev.event_payload(event))
    hashed = ev.hashed_parts(event_type, key, payload_json, postings)
    return _draft_of((event, postings, (event_type, payload_json, key, digest, getattr(event, "reversed_seq", None)), hashed))


def _repeat_of(first: AppendResult | LedgerError, command: cmd.Command, same_content: bool) -> AppendResult | LedgerError:
    if not same_content:
        return IdempotencyConflict(f"idempotency key {command.idempotency_key!r} was used with other content")
    if isinstance(first, AppendResult):
        return AppendResult(EXISTS, first.seq, first.event_type)
    return first


def _keys_of(items: list[tuple[int, cmd.Command, bytes]]) -> list[str]:
    return sorted({command.idempotency_key for _, command, _ in items})


def _known_keys(conn: Connection, items: list[tuple[int, cmd.Command, bytes]]) -> dict[int, AppendResult | LedgerError]:
    """For (index, command, digest) items whose key is already in the log: `exists`
    when the content matches, a conflict when it does not."""
    return _answers(items, storage_of(conn).read_known_keys(conn, _keys_of(items)))


def _answers(items: list[tuple[int, cmd.Command, bytes]], known: KnownKeys) -> dict[int, AppendResult | LedgerError]:
    answered: dict[int, AppendResult | LedgerError] = {}
    for index, command, digest in items:
        found = known.get(command.idempotency_key)
        if found is None:
            continue
        if found[0] == digest:
            answered[index] = AppendResult(EXISTS, found[1], found[2])
        else:
            answered[index] = IdempotencyConflict(
                f"idempotency key {command.idempotency_key!r} was used for event {found[1]} with other content"
            )
    return answered


def _load_book(conn: Connection, commands: list[cmd.Command]) -> _BatchBook:
    """What the rules need before the append lock: the kind of every account
    named, reversed events, and the holds being settled, which are closed here
    in one statement (a release or expiry racing with it finds them gone)."""
    book = _BatchBook()
    facts = _facts_of(conn)
    # Settlements, most of any batch, name no counter-account and no event: the rarer kinds are looked at alone.
    settles = [c for c in commands if type(c) is cmd.SettleRequest]
    others = [c for c in commands if type(c) is not cmd.SettleRequest] if len(settles) < len(commands) else []
    book.others = bool(others)
    codes = {getattr(c, name) for c in others for name in ("counter_account", "frozen_account") if hasattr(c, name)}
    if not facts.system or not codes <= facts.system.keys():  # a counter-account made since (one per chain)
        facts.system = dict(conn.execute(select(accounts.c.system_code, accounts.c.id).where(accounts.c.system_code.is_not(None))).all())
    book.system = facts.system
    reversed_seqs = sorted({c.seq for c in others if isinstance(c, cmd.ReverseEvent)})
    _load_reversal_targets(conn, book, reversed_seqs)
    _load_reversals(conn, book, reversed_seqs)
    account_ids = {*book.system.values(), *[c.owner_account_id for c in settles]}
    for c in others:
        match c:
            case cmd.GrantCredits() | cmd.PurchaseCredits() | cmd.RefundCredits() | cmd.FreezeCredits() | cmd.AdjustBalance():
                account_ids.add(c.account_id)
            case cmd.RequestPayout() | cmd.SettlePayout() | cmd.FailPayout():
                account_ids.add(c.owner_account_id)
            case cmd.ReverseEvent() if c.seq in book.events:
                account_ids.update(p.account_id for p in book.events[c.seq][1])
    kinds = facts.kinds
    book.kinds.update({a: kinds[a] for a in account_ids if a in kinds})
    for chunk in in_chunks(sorted(account_ids - book.kinds.keys())):
        found = conn.execute(select(accounts.c.id, accounts.c.kind).where(storage_of(conn).one_of(accounts.c.id, chunk))).all()
        book.kinds.update(found)
        facts.remember_kinds(found)
    _close_holds(conn, book, settles)
    return book


class _Facts:
    """What never changes once written: the system accounts and every
    account's kind. Kept per engine so a batch need not read them again."""

    def __init__(self) -> None:
        self.system: dict[str, int] = {}
        self.kinds: dict[int, str] = {}

    def remember_kinds(self, rows) -> None:
        if len(self.kinds) > ACCOUNT_KINDS_CACHED_MAX:
            self.kinds.clear()
        self.kinds.update(rows)


_FACTS_BY_ENGINE: "weakref.WeakKeyDictionary[Engine, _Facts]" = weakref.WeakKeyDictionary()


def _facts_of(conn: Connection) -> _Facts:
    facts = _FACTS_BY_ENGINE.get(conn.engine)
    if facts is None:
        facts = _FACTS_BY_ENGINE[conn.engine] = _Facts()
    return facts


def _close_holds(conn: Connection, book: _BatchBook, settles: list[cmd.SettleRequest]) -> None:
    """Close, in one statement, every hold a final capture here may settle;
    take from the others, in one more, what the captures that are not final
    charge; read the rest as they are.

    A hold closed (or taken from) for a command that then fails (charge above
    the hold, a key another process used meanwhile) is put back before the
    batch commits."""
    kinds, owner, hold_view_of = book.kinds, cmd.OWNER, cmd.hold_view_of
    owned = [c for c in settles if kinds.get(c.owner_account_id) == owner]
    closable = {c.hold_id for c in owned if c.final_capture}
    takes: dict[int, int] = {}
    for c in owned:
        if not c.final_capture:
            takes[c.hold_id] = takes.get(c.hold_id, 0) + c.charge_nano_usd
    if takes:
        book.closed_finally_too = closable.intersection(takes)
        for hold_id in book.closed_finally_too:
            del takes[hold_id]
    storage = storage_of(conn)
    closed = storage.close_holds(conn, sorted(closable))
    taken = storage.take_from_holds(conn, takes) if takes else []
    either = closed + taken
    book.holds.update({h.hold_id: hold_view_of((h.hold_id, h.account_id, h.amount_nano_usd, True)) for h in either})
    kinds.update(dict.fromkeys([h.account_id for h in either], cmd.CUSTOMER))  # holds are only ever placed on customers
    book.closing.update({h.hold_id: h for h in closed})
    book.taken.update({h.hold_id: [h, h.amount_nano_usd] for h in taken})
    # A hold that had less left than its captures is not active for them (book.hold says so).
    unclosed = sorted({c.hold_id for c in settles}.difference(book.closing, takes))
    for chunk in in_chunks(unclosed):  # those whose owner is no owner: the rules will say so
        for r in conn.execute(select(holds.c.id, holds.c.account_id, holds.c.amount_nano_usd).where(storage.one_of(holds.c.id, chunk))):
            book.holds[r.id] = cmd.HoldView(r.id, r.account_id, r.amount_nano_usd, True)
            book.kinds.setdefault(r.account_id, cmd.CUSTOMER)


def _add_hold_closed(holds_closed: dict[int, int], event: ev.RequestSettled) -> None:
    """Count what the settlement closes of its hold as closed for its customer:
    what it captured and released (a final capture: the whole hold)."""
    closed = event.charge_nano_usd + event.released_nano_usd
    holds_closed[event.customer_account_id] = holds_closed.get(event.customer_account_id, 0) + closed


def _take_hold_closed(holds_closed: dict[int, int], event: ev.RequestSettled) -> None:
    """`_add_hold_closed` undone, for a settlement refused under the lock: a customer with none left closes none."""
    left = holds_closed[event.customer_account_id] - event.charge_nano_usd - event.released_nano_usd
    if left:
        holds_closed[event.customer_account_id] = left
    else:
        del holds_closed[event.customer_account_id]


def _written_from_taken(taken: dict[int, list], event: ev.RequestSettled) -> ClosedHold:
    """A capture that is not final, written: its charge is no longer left to give back."""
    entry = taken[event.hold_id]
    entry[1] -= event.charge_nano_usd
    return entry[0]


def _lock_and_read(conn: Connection, book: _BatchBook, keyed: list[tuple[int, cmd.Command, bytes]],
                   prepared) -> tuple[int, bytes, bool, dict, dict[int, int]]:
    """Take the append lock, then (each read after it, so it sees every batch
    committed before) the keys committed meanwhile, the balances of every
    account posted to, and the active holds of customers debited outside a
    hold (their hold rows locked). Returns (last seq, last hash, whether the
    postings go in the event row, answers for late keys, the holds closed per
    customer if no settlement is refused)."""
    account_ids, debited_outside_hold = set(), set()
    add_account, settled = account_ids.add, ev.RequestSettled
    holds_closed: dict[int, int] = {}  # if no settlement is refused under the lock
    for event, postings, *_ in prepared:
        if type(event) is settled:  # its debit is its hold's: no customer's holds to lock for it
            _add_hold_closed(holds_closed, event)
            for account_id, _ in postings:
                add_account(account_id)
            continue
        for p in postings:
            add_account(p.account_id)
            if p.amount_nano_usd < 0 and book.kinds.get(p.account_id) == cmd.CUSTOMER:
                debited_outside_hold.add(p.account_id)
    # The storage keeps what it announced; the batch's own count changes if a settlement is refused under the lock.
    head = storage_of(conn).lock_head_and_read(conn, _keys_of(keyed), sorted(account_ids), dict(holds_closed))
    mark_append(conn, LOCK_TAKEN)
    book.balances.update(head.balances)
    customers = sorted(debited_outside_hold)
    acc.lock_customer_holds(conn, customers)
    book.held_by_account.update({a: view.held_nano_usd for a, view in acc.read_books(conn, customers).items()})
    return head.last_seq, head.last_hash, head.postings_in_event_row, _answers(keyed, head.known_keys), holds_closed


def _load_reversal_targets(conn: Connection, book: _BatchBook, seqs: list[int]) -> None:
    storage = storage_of(conn)
    for chunk in in_chunks(seqs):
        for r in conn.execute(select(ledger_events.c.seq, ledger_events.c.event_type).where(storage.one_of(ledger_events.c.seq, chunk))):
            book.events[r.seq] = (r.event_type, [])
        p = ledger_event_postings.c
        for r in conn.execute(
            select(p.event_seq, p.account_id, p.amount_nano_usd).where(storage.one_of(p.event_seq, chunk)).order_by(p.event_seq, p.leg)
        ):
            book.events[r.event_seq][1].append(ev.Posting(r.account_id, r.amount_nano_usd))


def _load_reversals(conn: Connection, book: _BatchBook, seqs: list[int]) -> None:
    storage = storage_of(conn)
    for chunk in in_chunks(seqs):
        for r in conn.execute(select(ledger_events.c.reverses_seq, ledger_events.c.seq).where(storage.one_of(ledger_events.c.reverses_seq, chunk))):
            book.reversals[r.reverses_seq] = r.seq


def set_postings_in_event_row(conn: Connection, on: bool) -> bool:
    """Where appends put postings from the next batch on: in each event's row
    (`on`) or as ledger_postings rows. Every replica must read them where
    they go (a release with migration 0031) before this is turned on. Set under
    the append lock, as the owner (the service's role may not); returns
    whether it was on before."""
    if not storage_of(conn).postings_in_event_row_possible:
        raise InvalidInput("only PostgreSQL keeps postings in their event's row: this database keeps them as rows")
    was_on = conn.execute(select(ledger_head.c.postings_in_event_row).where(ledger_head.c.id == 1).with_for_update()).scalar_one()
    conn.execute(update(ledger_head).where(ledger_head.c.id == 1).values(postings_in_event_row=on))
    return was_on

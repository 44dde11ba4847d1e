"""Writing the chain's head outside the database, and reading back every anchor
that can be read, for `ledger verify` (`ledger.anchors.check_anchors`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine

from app.anchoring import file as anchor_file
from ledger.anchors import Anchor, read_head
from ledger.db import storage_of
from ledger.errors import InvalidInput
from ledger.schema import utc_now

if TYPE_CHECKING:
    from app.anchoring.chain import ChainAnchorSettings

log = logging.getLogger("paralon.anchors")


class NothingToAnchor(InvalidInput):
    code = "nothing_to_anchor"


@dataclass(frozen=True)
class AnchorSettings:
    file: Path
    chain: ChainAnchorSettings | None = None  # None: the file only


def write_anchor(engine: Engine, settings: AnchorSettings, *, only_if_moved: bool = False) -> dict:
    """Anchor the committed head: on the chain first (when configured), then a line
    in the file naming its transaction. A chain that fails still gets the file's
    line, and the error is returned. `only_if_moved`: nothing when the file's
    newest anchor is already this head (beat's runs on an idle ledger)."""
    with engine.connect() as conn:
        seq, head_hash = read_head(conn)
        conn.rollback()
        # The durable writer commits first and answers after the flush: a head
        # it has not flushed yet would be anchored, then lost in a crash.
        storage_of(conn).wait_for_flush(conn)
    if seq == 0:
        raise NothingToAnchor("the ledger has no event yet: nothing to anchor")
    if only_if_moved and _newest_in_file(settings.file) == (seq, head_hash):
        return {"skipped": f"seq {seq} is anchored already", "seq": seq}
    anchor = Anchor(seq, head_hash, utc_now(), str(settings.file))
    chain_id = tx_hash = chain_error = None
    if settings.chain is not None:
        from app.anchoring import chain  # web3 loads only when a chain is configured

        try:
            chain_id, tx_hash = chain.send(chain.connect(settings.chain), settings.chain, seq, head_hash)
        except Exception as exc:  # any failure of the node or the wallet: the file's copy is still written
            chain_error = f"{type(exc).__name__}: {exc}"
            log.error("anchor of seq %s not written on the chain: %s", seq, chain_error)
    anchor_file.append(settings.file, anchor_file.line_of(anchor, chain_id, tx_hash))
    return {"seq": seq, "hash": head_hash.hex(), "anchored_at": anchor.anchored_at.isoformat(), "file": str(settings.file),
            "chain_id": chain_id, "tx_hash": tx_hash, "chain_error": chain_error}


def _newest_in_file(path: Path) -> tuple[int, bytes] | None:
    anchors, _ = anchor_file.read(path)
    return (anchors[-1].anchor.seq, anchors[-1].anchor.hash) if anchors else None


@dataclass
class ReadAnchors:
    anchors: list[Anchor] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)  # copies that disagree or are malformed: verify fails
    notes: list[str] = field(default_factory=list)  # copies not reached now, blocks scanned: said, never a failure


def read_anchors(settings: AnchorSettings, chain_from_block: int | None = None) -> ReadAnchors:
    """Every anchor of the file, each one's transaction on the chain, and (from
    `chain_from_block`, bounded) the wallet's transactions that the file may have lost."""
    file_anchors, findings = anchor_file.read(settings.file)
    result = ReadAnchors([a.anchor for a in file_anchors], findings)
    if settings.chain is None:
        if chain_from_block is not None:
            raise InvalidInput("--chain-from-block needs PARALON_CHAIN_RPC_URL and PARALON_ANCHOR_WALLET_KEY")
        return result
    from app.anchoring import chain  # web3 loads only when a chain is configured

    w3 = chain.connect(settings.chain)
    try:
        chain_id = w3.eth.chain_id
    except Exception as exc:  # the node is down: the file's anchors are still checked
        result.notes.append(f"chain anchors not read: {type(exc).__name__}: {exc}")
        return result
    _count_lost_lines(w3, settings, chain_id, file_anchors, result)
    for entry in file_anchors:
        if entry.tx_hash is None:
            continue
        if entry.chain_id != chain_id:
            result.notes.append(f"{entry.anchor.where}: its transaction is on chain {entry.chain_id}, the node is chain {chain_id}")
            continue
        try:
            on_chain = chain.read_tx(w3, settings.chain, chain_id, entry.tx_hash)
        except ValueError as exc:
            result.findings.append(f"{entry.anchor.where}: {exc}")
            continue
        if (on_chain.seq, on_chain.hash) != (entry.anchor.seq, entry.anchor.hash):
            result.findings.append(f"{entry.anchor.where}: the file says seq {entry.anchor.seq} hash {entry.anchor.hash.hex()}, "
                                   f"its transaction ({on_chain.where}) seq {on_chain.seq} hash {on_chain.hash.hex()}")
        result.anchors.append(on_chain)
    if chain_from_block is not None:
        known = {a.where for a in result.anchors}
        scanned, last_block = chain.scan(w3, settings.chain, chain_id, chain_from_block)
        result.anchors.extend(a for a in scanned if a.where not in known)
        result.notes.append(f"chain {chain_id}: blocks {chain_from_block} to {last_block} scanned for anchors")
    return result


def _count_lost_lines(w3, settings: AnchorSettings, chain_id: int, file_anchors: list, result: ReadAnchors) -> None:
    """The wallet sends nothing but anchors: a chain that counts more of its
    transactions than the file names lost lines (cut from the end by whoever
    rewound the database too); one call, where the bounded scan costs thousands."""
    sent = w3.eth.get_transaction_count(settings.chain.address)
    named = len({entry.tx_hash for entry in file_anchors if entry.tx_hash and entry.chain_id == chain_id})
    if sent > named:
        result.findings.append(f"chain {chain_id}: the anchor wallet sent {sent} transactions, the file names {named}: "
                               "lines are missing; find them with --chain-from-block")

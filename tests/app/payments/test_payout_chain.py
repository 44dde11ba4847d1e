"""The USDC rail against a real EVM node (anvil) and the project's own 6-decimal
token: each payout is paid exactly once, in the token's exact smallest unit,
whatever happens between signing and settlement: the sender killed after
storing or after broadcasting, a reorganisation that drops its block, a
dropped transaction replaced at a higher fee, an empty hot wallet, a
destination still cooling down, a reverted transfer, two senders at once.

Every test reads the money on both sides: the ledger (the owner's earnings,
the rail's in-flight and paid accounts, the platform's revenue) and the chain
(the destination's and the hot wallet's token balances, and how many Transfer
logs reached the destination)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from eth_abi import encode
from eth_account import Account
from prometheus_client import generate_latest
from sqlalchemy import func, select
from web3 import Web3
from web3.exceptions import TransactionNotFound, Web3RPCError

from app.http.status import metrics_registry
from app import wiring
from app.jobs.celery import PAYOUTS_SEND, celery
from app.payments import payouts as po
from app.payments.chain_settings import Token
from app.payments.crypto import TRANSFER_EVENT
from app.payments.chain_settings import PayoutChainSettings
from app.payments.payout_chain import AFTER_BROADCAST, AFTER_STORE, FAULT_ENV, StoredTx, send_once
from app.payments.schema import payout_transactions, payout_wallets
from app.payments.schema import payouts as payouts_table
from app.settings import Settings, SettingsError
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.db import make_engine
from ledger.schema import accounts, ledger_events, utc_now
from ledger.service import append_now
from ledger.verify import verify
from tests.support.anvil import deploy_stablecoin, mine, revert, running_anvil, snapshot

USD = 10**9
CONFIRMATIONS = 3
FEE_NANO_USD = USD // 4
RULES = po.PayoutRules(min_nano_usd=10 * USD, fee_nano_usd={po.USDC: FEE_NANO_USD, po.STRIPE: 0})
EARNINGS_NANO_USD = 100 * USD
PAYOUT_NANO_USD = 40 * USD
NET_RAW = 39_750_000  # $40 less the $0.25 fee, in micro-TUSD
WALLET_TOKENS_RAW = 1_000 * 10**6
WALLET_GAS_WEI = 10**18
REPLACE_AFTER_S = 600.0
TOKEN_BALANCES_SLOT = 3  # TestUSD's `balanceOf` mapping (after name, symbol and totalSupply; decimals is immutable)
KILLED = -signal.SIGKILL
CLI_TIMEOUT_S = 120
CHAIN_WAIT_S = 30


@dataclass
class Rig:
    database_url: str
    engine: object
    w3: Web3
    token: object
    wallet_key: str
    wallet: str
    owner: int
    destination: str
    settings: PayoutChainSettings

    def send(self, **kwargs):
        return send_once(self.engine, self.w3, self.settings, **kwargs)


def _rig(database_url: str, w3: Web3, wallet_tokens_raw: int = WALLET_TOKENS_RAW) -> Rig:
    engine = make_engine(database_url)
    token = deploy_stablecoin(w3)
    key = "0x" + bytes(Account.create().key).hex()
    wallet = Account.from_key(key).address
    w3.provider.make_request("anvil_setBalance", [wallet, hex(WALLET_GAS_WEI)])
    if wallet_tokens_raw:
        w3.eth.wait_for_transaction_receipt(token.functions.mint(wallet, wallet_tokens_raw).transact({"from": w3.eth.accounts[0]}))
    destination = Account.create().address
    with engine.begin() as conn:
        owner = acc.create_account(conn, cmd.OWNER, "GPU farm")
        po.set_destination(conn, owner, po.USDC, destination)
    append_now(engine, cmd.AdjustBalance(owner, EARNINGS_NANO_USD, "earnings for the test", f"earn:{owner}"))
    settings = PayoutChainSettings(w3.provider.endpoint_uri, key, Token(token.address, 6, "TUSD"), CONFIRMATIONS, REPLACE_AFTER_S)
    return Rig(database_url, engine, w3, token, key, wallet, owner, destination, settings)


@pytest.fixture
def anvil():
    with running_anvil() as w3:
        yield w3


@pytest.fixture
def rig(database_url, anvil):
    made = _rig(database_url, anvil)
    yield made
    made.engine.dispose()


@pytest.fixture
def pg_rig(postgres_url, anvil):
    made = _rig(postgres_url, anvil)
    yield made
    made.engine.dispose()


# --- What the ledger and the chain hold --------------------------------------------
def books(rig: Rig) -> dict[str, int]:
    with rig.engine.connect() as conn:
        codes = dict(conn.execute(select(accounts.c.system_code, accounts.c.id).where(accounts.c.system_code.is_not(None))).all())
        wanted = {"owner": rig.owner, "in_flight": codes[cmd.payouts_in_flight_account(po.USDC)],
                  "paid": codes[cmd.payouts_paid_account(po.USDC)], "revenue": codes[cmd.PLATFORM_REVENUE_ACCOUNT]}
        found = acc.read_books(conn, list(wanted.values()))
    return {name: found[account_id].balance_nano_usd for name, account_id in wanted.items()}


def before_payout() -> dict[str, int]:
    return {"owner": EARNINGS_NANO_USD, "in_flight": 0, "paid": 0, "revenue": 0}


def in_flight() -> dict[str, int]:
    return {"owner": EARNINGS_NANO_USD - PAYOUT_NANO_USD, "in_flight": PAYOUT_NANO_USD, "paid": 0, "revenue": 0}


def settled() -> dict[str, int]:
    return {"owner": EARNINGS_NANO_USD - PAYOUT_NANO_USD, "in_flight": 0, "paid": PAYOUT_NANO_USD - FEE_NANO_USD,
            "revenue": FEE_NANO_USD}


def transfers_to(rig: Rig, address: str) -> int:
    topic_to = "0x" + encode(["address"], [address]).hex()
    return len(rig.w3.eth.get_logs({"fromBlock": 0, "toBlock": "latest", "address": rig.token.address,
                                    "topics": [TRANSFER_EVENT.topic, None, topic_to]}))


def chain(rig: Rig, destination: str | None = None) -> dict[str, int]:
    destination = destination or rig.destination
    return {"destination": rig.token.functions.balanceOf(destination).call(),
            "wallet": rig.token.functions.balanceOf(rig.wallet).call(), "transfers": transfers_to(rig, destination)}


def unpaid() -> dict[str, int]:
    return {"destination": 0, "wallet": WALLET_TOKENS_RAW, "transfers": 0}


def paid() -> dict[str, int]:
    return {"destination": NET_RAW, "wallet": WALLET_TOKENS_RAW - NET_RAW, "transfers": 1}


def events(rig: Rig, event_type: str) -> int:
    with rig.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(ledger_events).where(ledger_events.c.event_type == event_type)).scalar()


def payout(rig: Rig, payout_id: int) -> dict:
    with rig.engine.connect() as conn:
        return po.payout_view(po.payout_row(conn, payout_id))


def stored(rig: Rig, payout_id: int) -> list:
    t = payout_transactions.c
    with rig.engine.connect() as conn:
        return conn.execute(select(payout_transactions).where(t.payout_id == payout_id).order_by(t.max_fee_per_gas_wei)).all()


def request(rig: Rig) -> int:
    return po.request_payout(rig.engine, rig.owner, po.USDC, PAYOUT_NANO_USD, RULES)["id"]


def ledger_verifies(rig: Rig) -> bool:
    with rig.engine.connect() as conn:
        return verify(conn).ok


def automine(rig: Rig, on: bool) -> None:
    rig.w3.provider.make_request("evm_setAutomine", [on])


SEND_ONCE = [sys.executable, "-c", "from app.cli import main; main()", "payouts", "send", "--rail", "usdc", "--once", "--json"]


def sender_env(rig: Rig, tmp_path: Path, fault: str | None = None) -> dict[str, str]:
    """What `paralon payouts send` runs with: this rig's database, node and token, the wallet key in a file."""
    key_file = tmp_path / "wallet.key"
    key_file.write_text(rig.wallet_key + "\n")
    env = {**os.environ, "PARALON_DATABASE_URL": rig.database_url, "PARALON_CHAIN_RPC_URL": rig.w3.provider.endpoint_uri,
           "PARALON_PAYOUT_WALLET_KEY": str(key_file), "PARALON_PAYOUT_TOKEN": f"{rig.token.address}:6:TUSD",
           "PARALON_CRYPTO_CONFIRMATIONS": str(CONFIRMATIONS), "PARALON_PAYOUT_FEE_USDC_USD": "0.25"}
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    return env


def paralon_send(rig: Rig, tmp_path: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    """`paralon payouts send --once --json` as its own process."""
    done = subprocess.run(SEND_ONCE, env=sender_env(rig, tmp_path, fault), capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, start_new_session=True)
    assert rig.wallet_key[2:] not in done.stdout + done.stderr, "the wallet's key is never shown"
    return done


def report_of(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, (done.stdout, done.stderr)
    return json.loads(done.stdout)[po.USDC]


# --- 1. The way it should go ---------------------------------------------------------
def test_a_payout_is_sent_and_settled_after_n_confirmations_to_the_exact_micro_unit(rig, caplog):
    payout_id = request(rig)
    assert books(rig) == in_flight() and chain(rig) == unpaid()

    first = rig.send()
    assert (first.signed, first.broadcast, first.settled) == (1, 1, 0)
    sent = payout(rig, payout_id)
    [tx] = stored(rig, payout_id)
    assert sent["state"] == po.SENT and sent["reference"] == tx.tx_hash and sent["raw_amount"] == str(NET_RAW)
    assert chain(rig) == paid(), "mined at once (anvil's automine): exactly amount - fee in micro-units"
    assert books(rig) == in_flight(), "not final before N confirmations"

    for confirmations in range(1, CONFIRMATIONS):
        assert rig.send().settled == 0
        assert payout(rig, payout_id)["confirmations"] == confirmations
        mine(rig.w3, 1)
    assert rig.send().settled == 1
    done = payout(rig, payout_id)
    assert done["state"] == po.SETTLED and done["confirmations"] == CONFIRMATIONS and done["reference"] == tx.tx_hash
    assert books(rig) == settled() and chain(rig) == paid()
    assert (events(rig, "PayoutSent"), events(rig, "PayoutSettled")) == (1, 1)
    assert rig.send().settled == 0 and chain(rig) == paid(), "nothing happens twice"
    assert ledger_verifies(rig)
    assert rig.wallet_key[2:] not in caplog.text


# --- 2 and 3. Killed for real, run again --------------------------------------------
def test_killed_after_storing_and_before_broadcasting_the_stored_transaction_is_broadcast_once(rig, tmp_path):
    payout_id = request(rig)
    assert paralon_send(rig, tmp_path, fault=AFTER_STORE).returncode == KILLED
    [tx] = stored(rig, payout_id)
    assert tx.broadcast_at is None and payout(rig, payout_id)["state"] == po.REQUESTED
    assert chain(rig) == unpaid() and books(rig) == in_flight(), "nothing left the wallet, nothing was lost"

    again = report_of(paralon_send(rig, tmp_path))
    assert chain(rig) == paid()
    assert (again["signed"], again["broadcast"]) == (0, 1), "broadcast again, never signed anew"
    mine(rig.w3, CONFIRMATIONS)
    assert report_of(paralon_send(rig, tmp_path))["settled"] == 1

    [only] = stored(rig, payout_id)
    assert only.tx_hash == tx.tx_hash and only.nonce == tx.nonce, "one transaction, one nonce"
    assert chain(rig) == paid() and books(rig) == settled() and ledger_verifies(rig)


def test_killed_after_broadcasting_and_before_recording_the_transfer_is_found_and_paid_once(rig, tmp_path):
    payout_id = request(rig)
    assert paralon_send(rig, tmp_path, fault=AFTER_BROADCAST).returncode == KILLED
    [tx] = stored(rig, payout_id)
    assert payout(rig, payout_id)["state"] == po.REQUESTED, "PayoutSent was never recorded"
    assert chain(rig) == paid(), "but the transfer went out"

    again = report_of(paralon_send(rig, tmp_path))
    assert chain(rig) == paid(), "found by its receipt, not paid again"
    assert again["signed"] == 0 and payout(rig, payout_id)["state"] == po.SENT
    assert payout(rig, payout_id)["reference"] == tx.tx_hash
    mine(rig.w3, CONFIRMATIONS)
    assert report_of(paralon_send(rig, tmp_path))["settled"] == 1
    assert len(stored(rig, payout_id)) == 1 and chain(rig) == paid() and books(rig) == settled()
    assert events(rig, "PayoutSent") == 1 and ledger_verifies(rig)


# --- 4. A reorganisation ----------------------------------------------------------------
def test_a_transfer_whose_block_leaves_the_chain_is_broadcast_again_and_settled_once(rig):
    payout_id = request(rig)
    fork_point = snapshot(rig.w3)
    assert rig.send().signed == 1
    tx_hash = payout(rig, payout_id)["reference"]
    mined_in = mined(rig, tx_hash)["blockNumber"]
    assert rig.send().settled == 0 and payout(rig, payout_id)["confirmations"] == 1

    revert(rig.w3, fork_point)  # the block with the transfer is gone, and the node forgot the transaction
    mine(rig.w3, 2)  # the chain goes on without it
    with pytest.raises(TransactionNotFound):
        rig.w3.eth.get_transaction_receipt(tx_hash)
    assert chain(rig) == unpaid()

    after = rig.send()
    assert (after.reorganised, after.broadcast, after.signed) == (1, 1, 0)
    receipt = mined(rig, tx_hash)
    assert receipt["blockNumber"] > mined_in, "the same stored transaction, mined in a new block"
    assert payout(rig, payout_id)["state"] == po.SENT and books(rig) == in_flight()
    mine(rig.w3, CONFIRMATIONS - 1)
    assert rig.send().settled == 1
    assert chain(rig) == paid() and books(rig) == settled()
    assert [row.tx_hash for row in stored(rig, payout_id)] == [tx_hash]
    assert (events(rig, "PayoutSent"), events(rig, "PayoutSettled")) == (1, 1) and ledger_verifies(rig)


# --- 5. Dropped, replaced ------------------------------------------------------------------
def test_a_dropped_transaction_is_replaced_at_a_higher_fee_under_its_nonce_and_only_one_is_mined(rig):
    payout_id = request(rig)
    automine(rig, False)
    assert rig.send().signed == 1
    [first] = stored(rig, payout_id)
    rig.w3.provider.make_request("anvil_dropTransaction", [first.tx_hash])

    assert rig.send().replaced == 0, "not before PARALON_PAYOUT_REPLACE_AFTER_S"
    later = utc_now() + timedelta(seconds=REPLACE_AFTER_S)
    report = rig.send(now=later)
    assert (report.replaced, report.broadcast, report.signed) == (1, 1, 0)
    old, new = stored(rig, payout_id)
    assert old.tx_hash == first.tx_hash and new.nonce == old.nonce
    assert rig.w3.eth.get_transaction(new.tx_hash)["nonce"] == first.nonce, "the replacement is in the node's pool"
    decoded = {row.tx_hash: _fees(row.raw_transaction) for row in (old, new)}
    for fee in ("maxFeePerGas", "maxPriorityFeePerGas"):
        assert decoded[new.tx_hash][fee] * 8 >= decoded[old.tx_hash][fee] * 9, f"{fee} at least +12.5 %"
    assert payout(rig, payout_id)["reference"] == new.tx_hash, "recorded as sent again, under the new hash"
    assert events(rig, "PayoutSent") == 2

    try:  # whoever still holds the first one broadcasts it again: the node keeps one per nonce
        rig.w3.eth.send_raw_transaction(bytes(old.raw_transaction))
    except Web3RPCError:
        pass
    mine(rig.w3, 1)
    mined = [h for h in (old.tx_hash, new.tx_hash) if _receipt(rig, h) is not None]
    assert len(mined) == 1 and chain(rig) == paid()
    mine(rig.w3, CONFIRMATIONS - 1)
    assert rig.send(now=later).settled == 1
    done = payout(rig, payout_id)
    assert done["state"] == po.SETTLED and done["reference"] == mined[0]
    mine(rig.w3, 1)
    assert chain(rig) == paid() and books(rig) == settled() and ledger_verifies(rig)


def _fees(raw: bytes) -> dict:
    return StoredTx("", 0, bytes(raw), utc_now(), None).fields


def mined(rig: Rig, tx_hash: str):
    """Its receipt once the node has mined it: anvil's automine answers the
    broadcast before its block is in, so a lookup at once can miss it."""
    return rig.w3.eth.wait_for_transaction_receipt(tx_hash, timeout=CHAIN_WAIT_S, poll_latency=0.05)


def _receipt(rig: Rig, tx_hash: str):
    try:
        return rig.w3.eth.get_transaction_receipt(tx_hash)
    except TransactionNotFound:
        return None


# --- 6. An empty hot wallet ---------------------------------------------------------------
def metric(rig: Rig, name: str) -> float:
    for line in generate_latest(metrics_registry(rig.engine)).decode().splitlines():
        if line.startswith(name + "{") and f'address="{rig.wallet}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on /metrics")


def test_an_empty_hot_wallet_sends_nothing_loses_nothing_says_so_and_pays_once_funded(database_url, anvil, caplog):
    rig = _rig(database_url, anvil, wallet_tokens_raw=0)
    try:
        payout_id = request(rig)
        report = rig.send()
        assert (report.signed, report.waiting_for_funds) == (0, 1)
        assert "waits for funds" in caplog.text and any(r.levelname == "WARNING" for r in caplog.records)
        assert metric(rig, "paralon_payouts_waiting_for_funds") == 1 and metric(rig, "paralon_payout_wallet_token_balance_raw") == 0
        assert stored(rig, payout_id) == [] and payout(rig, payout_id)["state"] == po.REQUESTED
        assert books(rig) == in_flight(), "the payout still holds its money in flight"
        assert chain(rig)["transfers"] == chain(rig)["destination"] == 0

        # Tokens, but no gas.
        rig.w3.eth.wait_for_transaction_receipt(rig.token.functions.mint(rig.wallet, WALLET_TOKENS_RAW).transact({"from": rig.w3.eth.accounts[0]}))
        rig.w3.provider.make_request("anvil_setBalance", [rig.wallet, hex(0)])
        report = rig.send()
        assert (report.signed, report.waiting_for_funds) == (0, 1)
        assert metric(rig, "paralon_payout_wallet_gas_balance_wei") == 0 and metric(rig, "paralon_payouts_waiting_for_funds") == 1
        assert stored(rig, payout_id) == [] and books(rig) == in_flight() and chain(rig) == unpaid()

        rig.w3.provider.make_request("anvil_setBalance", [rig.wallet, hex(WALLET_GAS_WEI)])
        report = rig.send()
        assert (report.signed, report.waiting_for_funds) == (1, 0)
        assert metric(rig, "paralon_payouts_waiting_for_funds") == 0
        assert metric(rig, "paralon_payout_wallet_token_balance_raw") == WALLET_TOKENS_RAW
        mine(rig.w3, CONFIRMATIONS)
        assert rig.send().settled == 1
        assert chain(rig) == paid() and books(rig) == settled() and ledger_verifies(rig)
    finally:
        rig.engine.dispose()


# --- 7. A destination inside its cooldown -----------------------------------------------
def test_a_changed_destination_returns_the_unsent_payout_and_receives_nothing_inside_its_cooldown(rig):
    payout_id = request(rig)
    new_destination = Account.create().address
    with rig.engine.begin() as conn:
        changed, _ = po.set_destination(conn, rig.owner, po.USDC, new_destination)
        assert po.payout_row(conn, payout_id)["state"] == po.FAILED, "not sent yet: back to earnings"
    assert rig.send().signed == 0
    assert stored(rig, payout_id) == [] and chain(rig) == unpaid() and chain(rig, new_destination) == unpaid()
    with pytest.raises(po.DestinationCoolingDown):
        po.request_payout(rig.engine, rig.owner, po.USDC, PAYOUT_NANO_USD, RULES)

    # A payout to it made as if the cooldown were over is still not sent while the sender's clock says otherwise.
    early = po.request_payout(rig.engine, rig.owner, po.USDC, PAYOUT_NANO_USD, RULES, now=changed.usable_from)
    report = rig.send(now=changed.usable_from - timedelta(seconds=1))
    assert (report.signed, report.waiting_for_destination) == (0, 1)
    assert stored(rig, early["id"]) == [] and chain(rig, new_destination) == unpaid()

    assert rig.send(now=changed.usable_from).signed == 1, "its cooldown over, the new destination is paid"
    mine(rig.w3, CONFIRMATIONS)
    assert rig.send(now=changed.usable_from).settled == 1
    assert chain(rig, new_destination)["transfers"] == 1 and chain(rig)["transfers"] == 0
    assert ledger_verifies(rig)


# --- 8. A reverted transfer --------------------------------------------------------------
def test_a_reverted_transfer_fails_the_payout_back_to_earnings_once_it_is_final(rig):
    """The wallet's tokens vanish between signing and mining (the slot of its balance
    set to zero): the transfer reverts on chain, deterministically."""
    payout_id = request(rig)
    automine(rig, False)
    assert rig.send().signed == 1
    slot = Web3.keccak(encode(["address", "uint256"], [rig.wallet, TOKEN_BALANCES_SLOT]))
    rig.w3.provider.make_request("anvil_setStorageAt", [rig.token.address, "0x" + slot.hex().removeprefix("0x"), "0x" + "00" * 32])
    assert rig.token.functions.balanceOf(rig.wallet).call() == 0
    mine(rig.w3, 1)
    tx_hash = payout(rig, payout_id)["reference"]
    assert rig.w3.eth.get_transaction_receipt(tx_hash)["status"] == 0

    assert rig.send().failed == 0, "not before it is N deep"
    assert payout(rig, payout_id)["state"] == po.SENT and books(rig) == in_flight()
    mine(rig.w3, CONFIRMATIONS - 1)
    assert rig.send().failed == 1
    failed = payout(rig, payout_id)
    assert failed["state"] == po.FAILED and "reverted" in failed["failure_reason"]
    assert books(rig) == before_payout(), "every nano-dollar back in the owner's earnings"
    assert chain(rig) == {"destination": 0, "wallet": 0, "transfers": 0}
    assert rig.send().signed == 0 and len(stored(rig, payout_id)) == 1, "never signed again"
    assert ledger_verifies(rig)


def test_a_nonce_spent_by_another_transaction_fails_the_payout_only_once_that_is_final(rig):
    """Someone else with the wallet's key spends the payout's nonce (its own transaction
    dropped meanwhile): the node answers 'nonce too low', none of the payout's
    transactions has a receipt; N blocks later none of them ever can, and only then
    does the payout fail back to earnings."""
    payout_id = request(rig)
    automine(rig, False)
    assert rig.send().signed == 1
    [ours] = stored(rig, payout_id)
    rig.w3.provider.make_request("anvil_dropTransaction", [ours.tx_hash])
    tip, max_fee = rig.w3.eth.max_priority_fee, 10 * rig.w3.eth.gas_price
    foreign = Account.from_key(rig.wallet_key).sign_transaction({
        "type": 2, "chainId": rig.w3.eth.chain_id, "nonce": ours.nonce, "to": rig.wallet, "value": 0, "gas": 21_000,
        "maxPriorityFeePerGas": tip, "maxFeePerGas": max_fee})
    rig.w3.eth.send_raw_transaction(foreign.raw_transaction)
    mine(rig.w3, 1)

    report = rig.send()
    assert (report.broadcast, report.failed, report.signed) == (0, 0, 0), "'nonce too low': nothing recorded, nothing failed yet"
    assert payout(rig, payout_id)["state"] == po.SENT and books(rig) == in_flight()
    mine(rig.w3, CONFIRMATIONS)
    assert rig.send().failed == 1
    assert payout(rig, payout_id)["state"] == po.FAILED and books(rig) == before_payout()
    assert chain(rig) == unpaid() and len(stored(rig, payout_id)) == 1 and ledger_verifies(rig)


# --- Two senders at once, and the beat's task ------------------------------------------
OWNERS_CONCURRENT = 10  # enough signing for the two runs to overlap


def test_two_senders_at_once_sign_each_payout_once_with_its_own_nonce(pg_rig, tmp_path):
    rig = pg_rig
    destinations = [rig.destination]
    for _ in range(OWNERS_CONCURRENT - 1):
        destination = Account.create().address
        with rig.engine.begin() as conn:
            owner = acc.create_account(conn, cmd.OWNER, "another GPU farm")
            po.set_destination(conn, owner, po.USDC, destination)
        append_now(rig.engine, cmd.AdjustBalance(owner, EARNINGS_NANO_USD, "earnings for the test", f"earn:{owner}"))
        po.request_payout(rig.engine, owner, po.USDC, PAYOUT_NANO_USD, RULES)
        destinations.append(destination)
    request(rig)
    env = sender_env(rig, tmp_path)
    senders = [subprocess.Popen(SEND_ONCE, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
               for _ in range(2)]
    try:
        outputs = [sender.communicate(timeout=CLI_TIMEOUT_S) for sender in senders]
    finally:
        for sender in senders:
            if sender.poll() is None:
                os.killpg(sender.pid, signal.SIGKILL)
                sender.wait()
    reports = [json.loads(out)[po.USDC] for out, _ in outputs]
    assert sum(r["signed"] for r in reports) == OWNERS_CONCURRENT, outputs
    mine(rig.w3, CONFIRMATIONS)
    rig.send()
    with rig.engine.connect() as conn:
        nonces = conn.execute(select(payout_transactions.c.nonce)).scalars().all()
        next_nonce = conn.execute(select(payout_wallets.c.next_nonce)).scalar_one()
    assert sorted(nonces) == list(range(next_nonce - OWNERS_CONCURRENT, next_nonce)), "one transaction per payout, each its own nonce"
    assert events(rig, "PayoutSettled") == OWNERS_CONCURRENT
    for destination in destinations:
        assert chain(rig, destination)["destination"] == NET_RAW and transfers_to(rig, destination) == 1
    assert rig.token.functions.balanceOf(rig.wallet).call() == WALLET_TOKENS_RAW - OWNERS_CONCURRENT * NET_RAW
    assert {k: v for k, v in books(rig).items() if k != "owner"} == {
        "in_flight": 0, "paid": OWNERS_CONCURRENT * (PAYOUT_NANO_USD - FEE_NANO_USD), "revenue": OWNERS_CONCURRENT * FEE_NANO_USD}
    assert ledger_verifies(rig)


def test_the_beats_task_is_skipped_with_a_clear_message_when_the_wallet_is_not_configured(database_url, monkeypatch):
    monkeypatch.setenv("PARALON_DATABASE_URL", database_url)
    for name in ("PARALON_PAYOUT_WALLET_KEY", "PARALON_PAYOUT_TOKEN", "PARALON_CHAIN_RPC_URL"):
        monkeypatch.delenv(name, raising=False)
    assert celery.tasks[PAYOUTS_SEND].apply(throw=True).get() == {
        "skipped": "USDC payouts are not configured: set PARALON_PAYOUT_WALLET_KEY, PARALON_PAYOUT_TOKEN, PARALON_CHAIN_RPC_URL"}
    assert celery.conf.beat_schedule["payouts-send"]["task"] == PAYOUTS_SEND


def test_the_wallet_key_is_read_from_a_file_and_a_wrong_one_is_refused_without_its_value(tmp_path, monkeypatch):
    key = "0x" + bytes(Account.create().key).hex()
    (tmp_path / "wallet.key").write_text(key + "\n")
    monkeypatch.setenv("PARALON_PAYOUT_WALLET_KEY", str(tmp_path / "wallet.key"))
    monkeypatch.setenv("PARALON_PAYOUT_TOKEN", "0x00000000000000000000000000000000000000c3:6:USDC")
    monkeypatch.setenv("PARALON_PAYOUT_REPLACE_AFTER_S", "90")
    read = wiring.payout_chain_settings(Settings.from_env())
    assert read.wallet_key == key and read.token.decimals == 6 and read.replace_after_s == 90
    assert key[2:] not in repr(read)
    wrong = "0x" + "zz" * 32
    monkeypatch.setenv("PARALON_PAYOUT_WALLET_KEY", wrong)
    with pytest.raises(SettingsError) as refused:
        wiring.payout_chain_settings(Settings.from_env())
    assert "PARALON_PAYOUT_WALLET_KEY" in str(refused.value) and wrong not in str(refused.value)


# --- ledger verify against the chain ------------------------------------------------------
def test_ledger_verify_checks_settled_and_in_flight_payouts_against_the_chain(rig, tmp_path):
    """`paralon ledger verify` finds each settled payout's Transfer on chain and each in-flight
    payout's transaction at the node; a reference that names another transaction fails it."""
    settled_id = request(rig)
    rig.send()
    mine(rig.w3, CONFIRMATIONS)
    assert rig.send().settled == 1
    verify_cli = [sys.executable, "-c", "from app.cli import main; main()", "ledger", "verify", "--json"]

    def ledger_verify() -> subprocess.CompletedProcess:
        return subprocess.run(verify_cli, env=sender_env(rig, tmp_path), capture_output=True, text=True,
                              timeout=CLI_TIMEOUT_S, start_new_session=True)

    with rig.engine.begin() as conn:  # a second owner's payout, in flight: sent, not yet mined
        other = acc.create_account(conn, cmd.OWNER, "another farm")
        po.set_destination(conn, other, po.USDC, Account.create().address)
    append_now(rig.engine, cmd.AdjustBalance(other, EARNINGS_NANO_USD, "earnings", f"earn:{other}"))
    po.request_payout(rig.engine, other, po.USDC, PAYOUT_NANO_USD, RULES)
    rig.w3.provider.make_request("evm_setAutomine", [False])
    try:
        assert rig.send().signed == 1
        done = ledger_verify()
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert "USDC payouts checked on chain 31337: 2" in json.loads(done.stdout)["payout_notes"]

        other_tx = rig.w3.eth.get_block(1)["transactions"][0].to_0x_hex()  # the token's deployment: no payout's transfer
        with rig.engine.begin() as conn:
            conn.execute(payouts_table.update().where(payouts_table.c.id == settled_id).values(reference=other_tx))
        done = ledger_verify()
        assert done.returncode == 1
        assert any(f"payout {settled_id} (settled by {other_tx}): no Transfer of 39750000" in p
                   for p in json.loads(done.stdout)["problems"])
    finally:
        rig.w3.provider.make_request("evm_setAutomine", [True])

"""Stablecoin deposits against a real EVM node (anvil): no credit before N
confirmations, one after, none again on rescans, none for a transfer that a
reorganisation removed, a reversal for one that vanished after its credit,
and none for other tokens, other addresses or logs that are not ERC-20 Transfers."""
from __future__ import annotations

import dataclasses

import pytest
from eth_abi import encode
from sqlalchemy import select
from web3 import Web3

from app.payments.chain_settings import CryptoSettings, Token
from app.payments.crypto import TRANSFER_EVENT, scan_once
from app.payments.deposits import deposit_address, derive_address
from app.payments.schema import crypto_transfers
from invoices.service import list_invoices
from ledger import accounts as acc
from ledger.errors import UnknownAccount, WrongAccountKind
from ledger.verify import verify
from tests.support.anvil import call, deploy_stablecoin, install_log_emitter, mine, revert, running_anvil, send, snapshot
from tests.support.celery_worker import celery_worker  # noqa: F401 (a fixture)
from tests.support.harness import make_fleet, wait_for

SEED = "abandon abandon abandon abandon abandon abandon abandon abandon abandon abandon abandon about"
CONFIRMATIONS = 3
USD = 10**9


@pytest.fixture
def chain(database_url):
    fleet = make_fleet(database_url, [], credits_usd="0")
    with running_anvil() as w3:
        token, other_token = deploy_stablecoin(w3), deploy_stablecoin(w3, "OTHER")
        settings = CryptoSettings(None, (Token(token.address, 6, "TUSD"),), CONFIRMATIONS, SEED)
        yield fleet, w3, token, other_token, settings
    fleet.engine.dispose()


def _balance(fleet) -> int:
    return fleet.balance(fleet.customer_id).balance_nano_usd


def test_each_customer_has_its_own_deposit_address_derived_from_the_seed(chain):
    fleet, _, _, _, settings = chain
    address = deposit_address(fleet.engine, settings, fleet.customer_id)
    assert address == deposit_address(fleet.engine, settings, fleet.customer_id) == derive_address(SEED, fleet.customer_id)
    with fleet.engine.begin() as conn:
        other = acc.create_account(conn, "customer", "another customer")
    assert deposit_address(fleet.engine, settings, other) != address
    with fleet.engine.begin() as conn:
        owner = acc.create_account(conn, "owner", "a GPU farm")
    for bad, error in ((999_999, UnknownAccount), (owner, WrongAccountKind)):
        with pytest.raises(error):
            deposit_address(fleet.engine, settings, bad)


def test_a_deposit_is_credited_once_after_n_confirmations(chain):
    fleet, w3, token, other_token, settings = chain
    address = deposit_address(fleet.engine, settings, fleet.customer_id)
    send(w3, other_token, address, 99_000000)  # a token nobody configured
    send(w3, token, w3.eth.accounts[3], 7_000000)  # someone else's address
    send(w3, token, address, 25_000000)  # 25.000000 TUSD, in the newest block: one confirmation
    assert scan_once(fleet.engine, w3, settings).credited == 0 and _balance(fleet) == 0
    mine(w3, CONFIRMATIONS - 2)
    assert scan_once(fleet.engine, w3, settings).credited == 0, "N - 1 confirmations"
    mine(w3, 1)
    report = scan_once(fleet.engine, w3, settings)
    assert report.credited == 1 and _balance(fleet) == 25 * USD
    for _ in range(2):  # rescans and more blocks change nothing
        mine(w3, 2)
        assert scan_once(fleet.engine, w3, settings).credited == 0
    assert _balance(fleet) == 25 * USD and fleet.events("CreditsPurchased") == 1
    with fleet.engine.connect() as conn:
        assert verify(conn).ok


def test_only_erc20_transfers_of_a_configured_token_count_at_their_exact_raw_amount(chain):
    """Logs are decoded by web3 from the Transfer ABI: another event under the same topic,
    or a value that is not one 256-bit word, is never read as a deposit."""
    fleet, w3, token, other_token, settings = chain
    address = deposit_address(fleet.engine, settings, fleet.customer_id)
    odd = Web3.to_checksum_address("0x" + "0d" * 20)  # configured too, but what it emits is no ERC-20 Transfer
    settings = dataclasses.replace(settings, tokens=(*settings.tokens, Token(odd, 6, "ODD")))
    transfer, sender, to = Web3.to_bytes(hexstr=TRANSFER_EVENT.topic), encode(["address"], [w3.eth.accounts[0]]), encode(["address"], [address])
    install_log_emitter(w3, odd, [transfer, sender, to], b"\x05")  # a value of one byte
    call(w3, odd)
    install_log_emitter(w3, odd, [transfer, sender, to, (7).to_bytes(32, "big")], b"")  # an ERC-721 Transfer of token 7
    call(w3, odd)
    w3.eth.wait_for_transaction_receipt(token.functions.approve(address, 5_000000).transact({"from": w3.eth.accounts[0]}))
    send(w3, other_token, address, 1_000000)  # a token nobody configured
    send(w3, token, address, 25_000001)  # the one deposit
    mine(w3, CONFIRMATIONS)
    report = scan_once(fleet.engine, w3, settings)
    assert (report.transfers_seen, report.credited) == (1, 1)
    assert _balance(fleet) == 25_000001 * 10**3
    with fleet.engine.connect() as conn:
        assert conn.execute(select(crypto_transfers.c.token, crypto_transfers.c.raw_amount)).one() == (token.address, 25_000001)


def test_a_transfer_removed_by_a_reorganisation_is_never_credited(chain):
    fleet, w3, token, _, settings = chain
    address = deposit_address(fleet.engine, settings, fleet.customer_id)
    mine(w3, 1)
    scan_once(fleet.engine, w3, settings)
    before = snapshot(w3)
    send(w3, token, address, 10_000000)
    assert scan_once(fleet.engine, w3, settings).transfers_seen == 1
    revert(w3, before)  # the block with the transfer is gone
    mine(w3, CONFIRMATIONS + 2)  # a longer chain without it
    report = scan_once(fleet.engine, w3, settings)
    assert report.forgotten == 1 and report.credited == 0
    mine(w3, CONFIRMATIONS)
    assert scan_once(fleet.engine, w3, settings).credited == 0 and _balance(fleet) == 0


def test_a_credited_transfer_that_vanishes_is_reversed(chain):
    fleet, w3, token, _, settings = chain
    address = deposit_address(fleet.engine, settings, fleet.customer_id)
    mine(w3, 1)
    scan_once(fleet.engine, w3, settings)
    before = snapshot(w3)
    send(w3, token, address, 10_000000)
    mine(w3, CONFIRMATIONS)
    assert scan_once(fleet.engine, w3, settings).credited == 1 and _balance(fleet) == 10 * USD
    revert(w3, before)
    mine(w3, CONFIRMATIONS + 3)
    report = scan_once(fleet.engine, w3, settings)
    assert report.reversed == 1 and _balance(fleet) == 0
    assert fleet.events("EventReversed") == 1
    with fleet.engine.connect() as conn:
        assert verify(conn).ok


def test_the_cli_and_the_api_give_the_same_address_and_the_cli_scans(chain):
    """`paralon crypto deposit-address`, `GET /v1/credits/crypto/address` and `paralon crypto scan --once`."""
    import json

    import httpx
    from click.testing import CliRunner

    from app.cli import main
    from app.tokens import create_token
    from tests.support.harness import serving

    fleet, w3, token, _, _ = chain
    env = {"PARALON_DATABASE_URL": fleet.database_url, "PARALON_CHAIN_RPC_URL": w3.provider.endpoint_uri,
           "PARALON_CRYPTO_TOKENS": f"{token.address}:6:TUSD", "PARALON_CRYPTO_CONFIRMATIONS": str(CONFIRMATIONS),
           "PARALON_CRYPTO_SEED": SEED}
    runner = CliRunner()

    def run(*args, expect=0):
        result = runner.invoke(main, list(args), env=env, catch_exceptions=False)
        assert result.exit_code == expect, result.output
        return json.loads(result.stdout if expect == 0 else result.stderr)

    cli = run("crypto", "deposit-address", str(fleet.customer_id), "--json")
    assert cli["chain_id"] == 31337 and cli["address"] == derive_address(SEED, fleet.customer_id)
    with fleet.engine.begin() as conn:
        customer_token = create_token(conn, fleet.customer_id, "customer")[1]
    with serving(fleet.database_url, **env) as proxy:
        api = httpx.get(proxy.url + "/v1/credits/crypto/address", headers={"authorization": f"Bearer {customer_token}"}).json()
    assert api == {"address": cli["address"], "chain_id": 31337}
    send(w3, token, cli["address"], 3_500000)
    mine(w3, CONFIRMATIONS)
    assert run("crypto", "scan", "--once", "--json")["credited"] == 1
    assert run("crypto", "scan", "--once", "--json")["credited"] == 0
    assert _balance(fleet) == 3_500_000_000
    assert run("crypto", "deposit-address", "999999", "--json", expect=2)["error"]["code"] == "unknown_account"


def test_a_real_celery_worker_on_redis_runs_the_deposit_scan(chain, celery_worker):
    """The watcher as a task: a `paralon worker` process on the local Redis
    takes `paralon.crypto_scan` and credits the confirmed deposit."""
    fleet, w3, token, _, settings = chain
    address = deposit_address(fleet.engine, settings, fleet.customer_id)
    send(w3, token, address, 2_000000)
    mine(w3, CONFIRMATIONS)
    worker = celery_worker({"PARALON_DATABASE_URL": fleet.database_url, "PARALON_CHAIN_RPC_URL": w3.provider.endpoint_uri,
                            "PARALON_CRYPTO_TOKENS": f"{token.address}:6:TUSD", "PARALON_CRYPTO_CONFIRMATIONS": str(CONFIRMATIONS),
                            "PARALON_CRYPTO_SEED": SEED}, concurrency=1, pool="solo")
    assert worker.result(worker.send("paralon.crypto_scan"))["credited"] == 1
    assert worker.result(worker.send("paralon.crypto_scan"))["credited"] == 0, "safe to run twice"
    assert _balance(fleet) == 2 * USD
    invoiced = wait_for(lambda: [i for i in list_invoices(fleet.engine, fleet.customer_id) if i["pdf_sha256"]], timeout_s=60)
    assert [i["amount_nano_usd"] for i in invoiced] == [2 * USD], "the outbox sent the credit's invoice to the worker"

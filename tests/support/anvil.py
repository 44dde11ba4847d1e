"""A real EVM node for tests: anvil from the npm package @foundry-rs/anvil
(installed by `make venv`), and the test stablecoin deployed from its
committed artifact."""
from __future__ import annotations

import json
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from web3 import Web3

from tests.support.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
ANVIL = ROOT / "node_modules" / ".bin" / "anvil"
ARTIFACT = Path(__file__).resolve().parent / "chain" / "TestUSD.json"
START_TIMEOUT_S = 30
PUSH1, PUSH32, MSTORE8, LOG0, STOP = 0x60, 0x7F, 0x53, 0xA0, 0x00  # EVM opcodes


@contextmanager
def running_anvil():
    port = free_port()
    process = subprocess.Popen([str(ANVIL), "--port", str(port), "--silent", "--chain-id", "31337"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    w3 = Web3(Web3.HTTPProvider(f"http://127.0.0.1:{port}", request_kwargs={"timeout": 10}))
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while not _answers(w3):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"anvil did not start: {process.stderr.read().decode() if process.stderr else ''}")
            time.sleep(0.05)
        yield w3
    finally:
        process.terminate()
        process.wait(10)


def _answers(w3: Web3) -> bool:
    try:
        return w3.eth.block_number >= 0
    except Exception:
        return False


def deploy_stablecoin(w3: Web3, symbol: str = "TUSD", decimals: int = 6):
    artifact = json.loads(ARTIFACT.read_text())
    sender = w3.eth.accounts[0]
    contract = w3.eth.contract(abi=artifact["abi"], bytecode=artifact["bytecode"])
    receipt = w3.eth.wait_for_transaction_receipt(contract.constructor(f"Test {symbol}", symbol, decimals).transact({"from": sender}))
    token = w3.eth.contract(address=receipt.contractAddress, abi=artifact["abi"])
    w3.eth.wait_for_transaction_receipt(token.functions.mint(sender, 10**15).transact({"from": sender}))
    return token


def send(w3: Web3, token, to: str, raw_amount: int) -> None:
    w3.eth.wait_for_transaction_receipt(token.functions.transfer(to, raw_amount).transact({"from": w3.eth.accounts[0]}))


def mine(w3: Web3, blocks: int) -> None:
    w3.provider.make_request("anvil_mine", [hex(blocks)])


def snapshot(w3: Web3) -> str:
    return w3.provider.make_request("evm_snapshot", [])["result"]


def revert(w3: Web3, snapshot_id: str) -> None:
    assert w3.provider.make_request("evm_revert", [snapshot_id])["result"] is True


def install_log_emitter(w3: Web3, address: str, topics: list[bytes], data: bytes) -> None:
    """Code at `address` that emits one log of these topics and data on every call: the
    logs a real ERC-20 never emits (another event under the Transfer topic, a malformed value)."""
    if len(topics) > 4 or len(data) > 255:
        raise ValueError("at most 4 topics and 255 bytes of data")
    code = bytearray()
    for offset, byte in enumerate(data):
        code += bytes([PUSH1, byte, PUSH1, offset, MSTORE8])
    for topic in reversed(topics):
        code += bytes([PUSH32]) + topic.rjust(32, b"\0")
    code += bytes([PUSH1, len(data), PUSH1, 0, LOG0 + len(topics), STOP])
    w3.provider.make_request("anvil_setCode", [address, "0x" + code.hex()])


def call(w3: Web3, address: str) -> None:
    w3.eth.wait_for_transaction_receipt(w3.eth.send_transaction({"from": w3.eth.accounts[0], "to": address, "gas": 100_000}))

"""Anchors of the ledger's chain outside the database: an append-only file
(always), a transaction on the EVM chain the deposits use (when a wallet key is
set), and the reading of both for `ledger verify` (`ledger.anchors` checks them)."""

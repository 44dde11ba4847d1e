"""The money core: an append-only, hash-chained, double-entry ledger.

Imports nothing from the rest of Paralon; integrations call its application
functions (see `ledger.service`).
"""

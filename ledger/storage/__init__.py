"""Where the ledger meets its database: one `Storage` per database.

`base.Storage` is the seam; `postgres` and `sqlite` implement it (the column
types the tables use on both are `ledger.column_types`). `ledger.db` chooses the
storage once, from the engine's URL, and `ledger.db.storage_of(conn)` finds it
again for every function that runs SQL: none of them asks which database it is on.
"""

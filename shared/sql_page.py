"""One page of an OpenAI list (files, batches) from SQLite: newest first, after a cursor id, one row
more than asked so the caller can tell `has_more`. Tables keep an increasing `seq` and a unique `id`."""

from __future__ import annotations


def newest_first(
    table: str,
    column: str,
    limit: int,
    after: str | None,
    purpose: str | None = None,
    owner: str | None = None,
    live_at: int | None = None,
) -> tuple[str, tuple[object, ...]]:
    """(SQL, parameters) selecting `column`, only `owner`'s rows when given, only rows not expired at
    `live_at` when given (the table has `expires_at`, NULL: never); `table` and `column` are ours,
    never a client's."""
    where: list[str] = []
    args: list[object] = []
    if owner is not None:
        where.append("owner = ?")
        args.append(owner)
    if after is not None:  # an unknown cursor pages from nothing (seq < -1), as OpenAI's does
        where.append(f"seq < COALESCE((SELECT seq FROM {table} WHERE id = ?), -1)")
        args.append(after)
    if purpose is not None:
        where.append("purpose = ?")
        args.append(purpose)
    if live_at is not None:
        where.append("(expires_at IS NULL OR expires_at > ?)")
        args.append(live_at)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    return f"SELECT {column} FROM {table} {clause} ORDER BY seq DESC LIMIT ?", (*args, limit + 1)

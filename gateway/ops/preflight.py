"""What `ctxfuse serve` checks of its disk before it loads anything: the data directory can be written
(a read-only mount or a directory of another user is refused with one line naming it and the fix, not
a traceback on the first upload), and every database already there is sound (a damaged one is named,
never opened for use and never replaced by an empty one). A full disk is not refused: what needs no
disk is served, and writes work again once there is room."""

from __future__ import annotations

from gateway.config import GatewayConfig
from shared.sqlite_store import open_db
from shared.storage_faults import check_writable

# the data dir's databases (gateway/app.py, access/key_stores.py, openai/responses.py) and their stores
DATABASES = {"batches.sqlite": "batch", "keys.sqlite": "keys", "responses.sqlite": "responses"}


def check_data_dir(config: GatewayConfig) -> None:
    """Raise the StorageFault of the first thing wrong with the data directory (none with Redis: the
    gateway's state is Redis's then)."""
    if config.redis_url is not None:
        return
    check_writable(config.data)
    for name, store in DATABASES.items():
        path = config.data / name
        if path.exists():
            open_db(path, durable=True, store=store).close()  # opening checks it (quick_check)

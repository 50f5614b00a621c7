"""The `ctxfuse` command line (serve, worker, edge, certs, bench, models)."""

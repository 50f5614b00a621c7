"""The cross-replica tests: a package, so that their cluster (conftest.py, package scope) stops once
they are done; in a plain directory pytest would keep it for the whole session, and its replicas
would take the batches of later Redis tests."""

"""The Files and Batch API: the stores, the routes, the runner and what runs one request."""

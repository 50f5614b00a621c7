"""Operating the gateway: health, readiness, metrics, request logs and the OpenAPI document."""

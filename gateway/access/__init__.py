"""Who calls and how much: tenants' API keys, the authentication middleware, per-key limits."""

"""The edge listener: mutual-TLS routes for devices, the chunk store and the bounds of an expanded request."""

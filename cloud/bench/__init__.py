"""Benchmarks: each module measures one component and returns JSON-able figures."""

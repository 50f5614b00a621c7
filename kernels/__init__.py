"""Triton kernels for the engine's hot paths, each beside its PyTorch reference."""

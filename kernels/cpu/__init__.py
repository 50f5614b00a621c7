"""Compiled CPU kernels (C++ through torch's extension builder), each beside its PyTorch reference.
They are built on first use into the ctxfuse cache; where no compiler works, `load_extension`
returns None with a warning and the engine keeps its PyTorch path."""

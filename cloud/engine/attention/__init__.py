"""Attention over the paged KV cache: the dense reference and its interface, the choice of kernels, the
CPU, GPU (Triton) and block-sparse paths, sliding windows."""

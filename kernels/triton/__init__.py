"""Triton kernels, one file per kernel family: a private `@triton.jit` function, a wrapper that checks
every input before launch, and the PyTorch reference beside it. Under `TRITON_INTERPRET=1` they run on
the CPU (slowly: tests keep grids tiny); the engine calls them only on a CUDA device."""

"""The device side: the model runner, its persistent input batch, CUDA graphs, device choice and the
memory profile."""

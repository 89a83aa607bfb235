"""The executor: the model runner, tensor-parallel workers and parallel layers, CUDA graphs."""

"""Decoding over the packed cache: CuPy kernels on CUDA, the torch reference elsewhere."""

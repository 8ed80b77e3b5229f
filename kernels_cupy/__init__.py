"""CUDA C kernels (`*.cu`) over the packed cache format of `kvcalib.quant`, loaded with cupy.RawModule."""

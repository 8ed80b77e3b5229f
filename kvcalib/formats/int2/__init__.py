"""The INT2 layout (`layout.py`) and the launch of its fused decode kernel, `kernels_cupy/int2_decode.cu`
(`launch.py`): KIVI, OScaR and KVLinC at 2 bits."""

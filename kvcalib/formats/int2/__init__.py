"""The INT2 layout (`layout.py`) and the launch of its fused decode kernel
(`launch.py`; the kernel, `int2_decode.cu`, beside them): KIVI, OScaR and KVLinC at 2 bits."""

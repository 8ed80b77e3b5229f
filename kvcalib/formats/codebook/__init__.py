"""The codebook layout (`layout.py`) and the launch of its fused decode kernel
(`launch.py`; the kernel, `codebook_decode.cu`, beside them): TurboQuant's scalar and vector codes."""

"""The codebook layout (`layout.py`) and the launch of its fused decode kernel, `kernels_cupy/codebook_decode.cu`
(`launch.py`): TurboQuant's scalar and vector codes."""

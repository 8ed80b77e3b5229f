"""The VecInfer layout (`layout.py`) and the launch of its fused decode kernel, `kernels_cupy/vq_decode.cu`
(`launch.py`)."""

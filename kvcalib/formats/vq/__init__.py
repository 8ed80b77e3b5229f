"""The VecInfer layout (`layout.py`) and the launch of its fused decode kernel
(`launch.py`; the kernel, `vq_decode.cu`, beside them)."""

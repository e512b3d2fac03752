"""CUDA kernels for zcomm's quantization ops (loaded lazily; importing this needs no GPU)."""

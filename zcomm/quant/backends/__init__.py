"""Backend implementations of the quantization ops; each module registers its kernels on import."""

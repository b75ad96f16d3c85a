"""Native CPU kernels, built from their C++ source on first use: the shared build loader and the small-batch kernels."""

"""CUDA kernels (numba.cuda): fused dequant-GEMM for packed weights; API in .ops."""

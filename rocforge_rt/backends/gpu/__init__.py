"""GPU backend: CUDA and HIP drivers, launch handles, graphs, the kernel library and the ops."""

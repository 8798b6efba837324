"""Kernel benchmarks and GPU correctness checks (kernel engineer): `python -m falcon_lab.bench kernels`."""

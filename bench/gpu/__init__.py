"""Helpers of `bench/bench_gpu.py`: shapes and formulas (`shapes`), the phases that run in child
processes (`jax_phases`, `torch_phases`) and the markdown report (`report`)."""

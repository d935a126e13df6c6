"""Measurement code beside its results: the training-step benchmark and the GPU check.

Not part of the `eagle31` library: nothing in `eagle31/` imports from here. Run the
commands from the repository root as modules (`python -m benchmarks.train_step ...`,
`python -m benchmarks.gpu_check ...`) so that both `eagle31` and `benchmarks` import.
"""

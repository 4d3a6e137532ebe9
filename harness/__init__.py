"""Harnesses over the serving stack: the demo, the benchmarks, the A/B runs and the checks that drive
engines end to end (`kimik3 demo`, `coverage`, `media-bench`, `eagle-ab`; `python -m
harness.scaling_bench`, `python -m harness.multiprocess_engine_check`).  They import `serving` and
the layers under it; nothing under them imports a harness."""

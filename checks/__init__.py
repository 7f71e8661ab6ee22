"""GPU-free half of podkit: job config, model shapes, GPU catalog, memory model, checks, report.

Nothing in this package imports torch: it must answer on a laptop in well under a second.
"""

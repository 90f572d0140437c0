"""``make gpu-check``: the engine probe and the whole service on one GPU (``benchmarks/gpu/run.sh``).

``measures`` (pure: the figures from step rows, events and rank logs), ``probe`` (etrain's ``Trainer``
against the same loop written with transformers), ``service_jobs`` (a clean job and a killed one over
REST), ``table`` (docs/gpu.md's table from the two result files). Not installed with etrain (pyproject lists
only the ``etrain`` packages, as for the rest of ``benchmarks/``): run from the repository root.
"""

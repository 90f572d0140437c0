"""The training engine of one rank: the ``Trainer`` (model, optimizer, data, step), parallelism (mesh, TP,
FSDP2/DDP, pipeline), seeded init, data sets and sampler, and timing; runs under Ray or ``torchrun``.
"""

"""What the service and the ranks share and both apply (pure: no torch, no Ray): the run config, the error
family, the checkpoint manifest format, the messages between the supervisor and the ranks, the layout rules
that need no model family, the rank arithmetic (topology) and the one way to open a job's files (safe paths).
It asks no model family (``etrain.workers.families`` builds on it, never the other way round).
"""

"""What the service and the ranks share (pure: no torch, no Ray): the run config, the error family,
the checkpoint manifest format, and the messages between the supervisor and the ranks.
"""

"""Checkpoints: DCP save/load with resharding, the commit of step directories, in-memory snapshots, storage
(local and ``s3://``) and its faults, and Hugging Face weights in and out.
"""

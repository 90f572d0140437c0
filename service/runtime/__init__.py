"""The Ray adapters: the per-job supervisor actor and its parts (checkpoints, step reports, capacity
watch, gauges, export task, drills), its worker group, the spare pool, the cluster handle and the
control dispatcher. The only part of the service that imports Ray.
"""

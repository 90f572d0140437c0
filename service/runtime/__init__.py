"""The Ray adapters: the per-job supervisor actor, its worker group, the spare pool, the cluster handle
and the control dispatcher. The only part of the service that imports Ray.
"""

"""The job manager's parts (service/manager.py ``JobManager`` stays the API's one entry point).

``scheduler``: the queue's admission passes; ``poller``: supervisor updates into the store;
``checkpoints``: finding a job's committed checkpoint. What a spec means to the runtime (its policy, its
gang) is service/decisions/job_policy.py.
"""

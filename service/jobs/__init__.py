"""The job manager's parts (service/manager.py ``JobManager`` stays the API's one entry point).

``scheduler``: the queue's admission passes; ``poller``: supervisor updates into the store; ``policy``:
what a spec means to the runtime; ``checkpoints``: finding a job's committed checkpoint.
"""

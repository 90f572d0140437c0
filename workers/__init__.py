"""The ranks' side of etrain, in rooms (``tests/architecture/test_rooms.py`` states who may import whom):

* ``protocol``: what the service and the ranks share and both apply (pure: no torch, no Ray);
* ``families``: the model families (declarations, the registry, the layout rules that ask a family, torch
  modules, the builder);
* ``checkpoints``: save/load, commit, snapshots, storage, Hugging Face in and out;
* ``engine``: one rank's Trainer (parallelism, pipeline, mesh, init, optimizer, data, timing);
* ``rank``: the rank process (Ray actor, warm spares, rank log, reports, step control, chaos drills).
"""

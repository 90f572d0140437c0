"""Settings for every Ray cluster the tests start (local instances, ``ray.cluster_utils.Cluster`` nodes and
``deploy/local/up.sh``), set before any of them starts.

Ray's per-node metrics agent and usage-stats reporting kept a 3-node test cluster at 12% of a 2-core
machine while idle, 5% without them (measured): the tests read etrain's own ``/metrics`` (the control
plane's store), never Ray's metrics export, and this machine has no network to report usage to. The
suite is CPU-bound on 2 cores, so that idle load was suite time. A deployment keeps both (the Ray
dashboard shows the ``etrain_*`` gauges).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_enable_metrics_collection", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

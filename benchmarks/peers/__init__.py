"""The peers etrain's recovery and startup are measured against (Ray Train v2, torchrun's elastic agent),
running the same job as etrain: one model, one data stream, one batch, one checkpoint cadence."""

"""The shared runtime: one training run of any algorithm on every rank, and the distributed
machinery it stands on (collectives, gradient reduction and compression, checkpoints, metrics,
load balancing, precision, the peer watchdog)."""

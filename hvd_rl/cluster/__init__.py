"""Cluster tooling: launching ranks, the installation doctor, and renderers for SLURM,
Kubernetes (MPIJob) and AWS Batch multi-node jobs."""

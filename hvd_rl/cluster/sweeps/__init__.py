"""Hyperparameter sweeps and seed studies on the cluster (Optuna; issue 35): docs/sweeps.md."""

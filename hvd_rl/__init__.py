"""hvd_rl: distributed PPO with Horovod."""
__version__ = "0.1.0"

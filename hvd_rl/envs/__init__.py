"""Environments: per-rank vector environments (vector.py) and environment ids (ids.py).

This package's __init__ imports nothing, so that config.py can check ids (envs.ids) without
importing the environment code, which itself reads the config."""

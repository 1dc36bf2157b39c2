"""Using a trained policy: evaluation (and, beside it, video and export)."""

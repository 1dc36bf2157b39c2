"""Analysis off the hot path: scaling-study reports, the weak-scaling projection, learning
curves and learning-study plans."""

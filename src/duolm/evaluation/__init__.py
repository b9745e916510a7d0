"""Evaluation: task metrics as pure functions (metrics.py) and the papers' evaluation protocols."""

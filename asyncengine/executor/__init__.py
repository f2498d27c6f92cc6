"""Executors: what the engine core calls to run a step, wherever the model lives (see abstract.py)."""

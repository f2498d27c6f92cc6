"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and their config.

The scheduler reserves draft slots (``SchedulerOutput.num_spec_tokens``); the model runner asks a
proposer for drafts, verifies them in the same forward pass and returns the accepted tokens.
"""
from asyncengine.config.speculative import SpeculativeConfig

__all__ = ["SpeculativeConfig"]

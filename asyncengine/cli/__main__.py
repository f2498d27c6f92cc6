"""``python -m asyncengine.cli``, as it ran when the command was one module."""
from asyncengine.cli import entry

entry()

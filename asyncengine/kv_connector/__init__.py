"""The KV connector: KV blocks that come from, or go to, somewhere other than this core's cache.

``base.py`` is the seam (a scheduler side and a worker side), ``messages.py`` what crosses from
one to the other each step, ``factory.py`` picks an implementation from the config, and each
implementation has its folder (``offload/``: a host-memory and disk tier for the prefix cache).
"""

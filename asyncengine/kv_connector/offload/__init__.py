"""Connector 1: a tiered prefix cache. Blocks evicted from the device cache go to a bounded host
pool; full prompt blocks are written to a directory that survives restarts. See docs/kv_connector.md."""

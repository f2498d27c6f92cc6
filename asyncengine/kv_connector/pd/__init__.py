"""Connector 2: disaggregated prefill/decode between engine cores on one host. A prefill core
writes each request's prompt KV to a transfer file in shared memory (tmpfs) right after the forward
that computed it; a decode core claims the file, copies it into its blocks and computes only the
last prompt token. See docs/kv_connector.md."""

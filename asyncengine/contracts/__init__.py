"""The ground floor: what crosses the executor seam, typed once. The scheduler's step
(``sched_output.py``: ``SchedulerOutput`` in, ``ModelRunnerOutput`` back, ``EngineCoreOutputs`` to
the front end), the KV cache a worker reports and the core plans (``kv_cache_spec.py``,
``kv_sizing.py``) and the KV connector's per-step messages (``connector_messages.py``). The core,
the executor, the worker and the connectors all import these; these import none of them."""

"""The engine core and the places it runs: ``core.py`` (``EngineCore``: scheduler + executor + the
step pipeline, in the caller's thread), ``core_proc.py`` (a core in its own process, data-parallel
cores), ``ray_cores.py`` (cores as Ray actors); ``core_stats.py`` and ``gc_policy.py`` serve them.
The front end (``asyncengine.engine``) reaches these only through its core client."""

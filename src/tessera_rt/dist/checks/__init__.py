"""tessera_rt.dist.checks: the checkers that watch the collectives from above.

It owns the cross-rank agreement check on by default (``consistency``), the debug modes
and flight records (``debug``), the hang watchdog (``watchdog``: what a rank reports and
how ranks' waits compare; ``watchdog_thread``: the thread that samples, probes and ends the
job) and deterministic reductions (``determinism``).  Each plugs into the hot paths by
filling a slot of ``dist.comm.hooks.SEAM`` (or a registry of ``dist.comm``) when it is
imported; the collectives never import a checker.

It may import ``dist.comm`` and the layers below dist (``backend``, ``runtime``,
``dtypes``, ``kernels``); not ``dist.tensor``, ``dist.ccl`` or ``dist.checkpoint``.
``tests/package/test_architecture.py`` enforces the order.
"""

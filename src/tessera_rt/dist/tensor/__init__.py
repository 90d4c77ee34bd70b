"""tessera_rt.dist.tensor: DTensors, their layouts and how a layout changes.

It owns layouts and placements (``layout``), shard arithmetic (``shard``), the DTensor
type (``dtensor_type``) and its constructors (``dtensor``; ``pieces`` checks ``from_local``'s
pieces, ``rng`` makes ``rand``/``randn``'s values) and its NumPy interop (``interop``), the op
dispatcher (``dispatch``) with the sharding rules it runs (registered in one table:
``rules`` owns it and the elementwise, transpose and reshape rules, ``reduction_rules`` those
of matmul, reductions, norms and attention) and the layout solver (``solve``), the
redistribution planner (``redistribute``, its steps built by ``plan_steps``) and its compiled
form (``compiled_plan``), the collectives on DTensors (``dtensor_collectives``) and the cost
model redistribution choices are priced with (``cost``).

It may import ``dist.comm``, ``dist.checks`` and the layers below dist (``backend``,
``runtime``, ``dtypes``, ``kernels``); not ``dist.ccl`` or ``dist.checkpoint``, and
nothing above dist: autodiff plugs in through ``dist.comm.hooks`` (``differentiable``,
``vjp_rule``).  ``tests/package/test_architecture.py`` enforces the order.
"""

"""Disaggregated serving: ``--node-role router|prefill|decode``. Prefill nodes run prompts and
hand the KV cache to decode nodes; a router serves HTTP and balances both pools. The roles are
pure cores (``*_core.py``) driven by asyncio adapters, and by ``mlxcel.sim`` in tests. See
docs/disaggregated.md."""

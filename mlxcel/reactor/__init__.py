"""One reactor per process: the typed message bus and the Node that owns its tasks, the
adapter that carries a role core's effects, the Endpoint roles send through, and faults
scheduled on the loop's clock."""

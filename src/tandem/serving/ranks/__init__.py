"""The rank control plane: the rank processes, the typed messages between them and the
front end, and the `ProcessEngineClient` that owns them."""

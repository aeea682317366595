"""Model implementations on attnserve's layers (see attnserve.model.registry)."""

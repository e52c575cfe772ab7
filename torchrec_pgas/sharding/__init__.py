"""The PGAS sharding types: ``EmbeddingSharding`` subclasses and their exchanges."""

"""Model implementations; look them up by architecture through models.registry.ModelRegistry."""

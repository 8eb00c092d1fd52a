"""The filter chains: the API (:mod:`rmqfast.filters.api`), one module per filter, and the registry
(:mod:`rmqfast.filters.registry`) that declares each chain's order once; the worker builds its chains
by walking the registry.  This package file imports nothing, so that importing the API (a leaf the
relay, the limits and the features use) does not pull the filters in."""

"""Settings: what every section of the configuration is parsed and checked with.

:mod:`rmqfast.settings.base` is a leaf (it imports no feature): the features declare their own
sections with it, and :mod:`rmqfast.config` assembles them into the one validated ``Config``.
"""

"""The harness's errors: every one is a :class:`HarnessError`."""

from __future__ import annotations


class HarnessError(RuntimeError):
    """Base of every error of the test harness."""


class ToolMissingError(HarnessError):
    """``java`` or ``mvn`` is not installed / not on PATH."""


class MavenBuildError(HarnessError):
    """Maven failed to build the Java side; the message has the tail of its output."""


class ClusterError(HarnessError):
    """The name server or broker failed to start, died, or did not become ready in time."""

"""One exception hierarchy, shared by the compiled and the pure-Python codecs."""


class RemotingError(Exception):
    """Base of every error rmqfast raises about Remoting protocol data."""


class FrameError(RemotingError, ValueError):
    """A frame is malformed: bad length, unknown serialize type, unparsable header."""


class FrameTooLarge(FrameError):
    """A frame or header is longer than the configured limit (checked before allocation)."""


class HeaderError(FrameError):
    """A frame's header cannot be decoded (invalid JSON, truncated binary header...)."""


class BodyError(RemotingError, ValueError):
    """A message body (batch, store records, route JSON, properties) is malformed."""


class ConfigError(ValueError):
    """The configuration is invalid. The message names the key, the value and what is allowed."""


class TwinMismatchError(RuntimeError):
    """State shared between processes was made by the other twin (compiled vs pure Python), whose
    updates it would corrupt: e.g. the limiter's shared buckets (compiled: CAS, pure: flock)."""


class ConfigErrors(ConfigError):
    """Several configuration errors; ``errors`` holds one message per problem."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))

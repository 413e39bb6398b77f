"""User-facing errors: each message is one line saying what failed and what to do."""


class PdserveError(Exception):
    """Base for errors shown to users as a single line."""


class ModelLoadError(PdserveError):
    """The model path is missing, unreadable or not a model pdserve can run."""


class RequestError(PdserveError):
    """A request is invalid (too long, bad sampling parameters, ...)."""


class FatalError(PdserveError):
    """The service cannot go on (one of its rank processes died): it fails the requests it
    holds and exits non-zero, for its supervisor (systemd) to restart it."""

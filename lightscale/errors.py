"""The error lightscale raises for bad settings, before any work starts."""


class ConfigurationError(ValueError):
    """A setting is invalid; the message names the bad value and what would be valid.

    A ``ValueError`` so callers that catch that keep working; the CLI prints it without a traceback.
    """

"""The error lightscale raises for bad settings, before any work starts; the one for a missing optional extra."""

from typing import Any


class ConfigurationError(ValueError):
    """A setting is invalid; the message names the bad value and what would be valid.

    A ``ValueError`` so callers that catch that keep working; the CLI prints it without a traceback.
    """


def import_extra(module: str, extra: str, *, error: type[Exception] = ImportError) -> Any:
    """``module`` (an optional dependency), or ``error`` naming the lightscale extra that installs it.

    Library calls raise the ImportError; a setting that the CLI reads (float8, export --hf) passes
    ``error=ConfigurationError``, which the CLI prints without a traceback.

    Example:
        >>> litdata = import_extra("litdata", "litdata")
    """
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as err:
        raise error(f"{module} is not installed; install it with: pip install 'lightscale[{extra}]'") from err

"""Old home of :mod:`lightscale.testing.local_s3` (a test server, not storage), kept for a release because
docs/plugins/checkpoint.md showed ``python -m lightscale.storage.local_s3``: importing it warns and gives the same
functions; run as a script, it runs the server's command line."""

from __future__ import annotations

import warnings

from lightscale.testing.local_s3 import local_s3_server, main, s3_environment

__all__ = ["local_s3_server", "main", "s3_environment"]

warnings.warn("lightscale.storage.local_s3 moved to lightscale.testing.local_s3", DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    main()

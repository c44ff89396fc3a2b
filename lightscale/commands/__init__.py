"""Subcommands of ``lightscale`` (``estimate``, ``plan``, ``consolidate``, ``doctor``, schedule pictures), run by
lightscale/cli.py."""

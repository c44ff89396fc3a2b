"""Subcommands of ``lightscale`` that read a training config (``estimate``, ``plan``); lightscale/cli.py runs them."""

"""Where checkpoints live: local paths and fsspec URLs (urls.py)."""

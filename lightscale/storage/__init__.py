"""Bytes on storage: atomic directory commits, loading that never runs code (single files and DCP), shape checks,
the multi-node shared-directory check, and checkpoint locations that are fsspec URLs (urls.py)."""

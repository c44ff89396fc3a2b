"""Checkpoints: the one portable layout every strategy writes and reads, safe and atomic I/O, conversion.

Modules: layout.py (the DCP layout: save, load with resharding, trainer state), deepspeed_dir.py (DeepSpeed's own
directories, read offline), safe_io.py (single files), safe_dcp.py (DCP reads that never unpickle code), atomic_dir.py
(directory swap), async_save.py (background saves), rng.py (every rank's random state), shape_check.py, shared_dir.py
(multi-node directory check), convert.py (export/convert).
"""

from lightscale.storage.safe_io import SafeCheckpointIO, allow_in_checkpoints

__all__ = ["SafeCheckpointIO", "allow_in_checkpoints"]

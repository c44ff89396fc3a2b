"""Single-tensor all-gather and reduce-scatter under whichever name this torch has.

torch 2.13 names them ``all_gather_single`` / ``reduce_scatter_single`` and deprecates the older
``all_gather_into_tensor`` / ``reduce_scatter_tensor``, which are all earlier releases (2.8+) have.

Example:
    >>> all_gather_single(out, local, group=group)  # out: local stacked along dim 0 over the group's ranks
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

"""Building blocks applied to a single-device model from outside: data, tensor, pipeline and expert parallelism."""

from lightscale.parallel.data_parallel import BucketedGradReducer, broadcast_module_state

__all__ = ["BucketedGradReducer", "broadcast_module_state"]

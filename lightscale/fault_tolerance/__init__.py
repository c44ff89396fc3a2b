"""Fault tolerance on torchft, in one place (the ``[ft]`` extra; torchft is imported nowhere else):

settings.py          ``FaultTolerance``: the user's settings, checked before any work, and torchft's Manager
lighthouse.py        torchft's lighthouse (``python -m lightscale.fault_tolerance.lighthouse``);
                     and the same as a child process on loopback, for tests and benchmarks (``lighthouse()``)
step.py              per-step mode, torch level: quorum, the gradient mean over the replicas, the commit gate
replica.py           per-step mode, a strategy's side (bucketed_ddp, the FSDP2 family): the replica, its
                     data part, healing from a peer, the state it hands to the checkpointer
sharded_replica.py   the FSDP2 family's replica (hsdp across launches)
diloco.py            DiLoCo's per-round mode: the outer sync across workers that may fail and rejoin
diloco_worker.py     what a fault-tolerant DiLoCo worker adds to its strategy
"""

from lightscale.fault_tolerance.settings import FaultTolerance

__all__ = ["FaultTolerance"]

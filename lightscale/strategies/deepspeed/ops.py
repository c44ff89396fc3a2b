"""Build DeepSpeed's CPU ops ahead of time: ``python -m lightscale.strategies.deepspeed.ops``.

DeepSpeed compiles its CPU Adam (zero*_offload), async I/O (zero_infinity) and, on the CPU accelerator, shared-memory
collective (every ZeRO name: ``deepspeed.init_distributed`` loads it) ops on first use. Run inside a
training job, that compile takes minutes on every rank's clock (one rank builds, the others wait on its lock) and
a job killed mid-build leaves a stale lock behind. ``make venv`` runs this once, into the directory ZeroStrategy
uses (``TORCH_EXTENSIONS_DIR``, by default ``<venv>/torch_extensions``), like ``DS_BUILD_CPU_ADAM=1`` at install.
"""

from __future__ import annotations

from lightscale.patches.deepspeed import extensions_dir


def build_cpu_ops() -> list[str]:
    """Load (compiling if needed) every CPU op this machine can build; returns the names built."""
    extensions_dir()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    # The accelerator's own builder, as deepspeed.comm.torch.build_shm_op asks for it (None off the CPU accelerator).
    shm = get_accelerator().create_op_builder("ShareMemCommBuilder")
    built = []
    for builder in (CPUAdamBuilder(), AsyncIOBuilder(), shm):
        if builder is not None and builder.is_compatible(verbose=False):
            builder.load(verbose=False)
            built.append(builder.name)
    return built


if __name__ == "__main__":
    print("DeepSpeed CPU ops ready:", ", ".join(build_cpu_ops()) or "none compatible")

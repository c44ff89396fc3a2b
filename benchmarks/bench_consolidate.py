"""``lightscale consolidate``: peak memory while consolidating ÷ the full weights, beside the optimizer state it skips.

Two checkpoints in the portable layout, each with AdamW state (two fp32 moments per parameter, a step each):
    * the small GPT recipe (``gpt/small_fsdp2.yaml``'s model: 6 layers, 384 wide) trained one step under fsdp2 on 2
      forked gloo ranks and saved by the strategy;
    * a synthetic 1B-parameter layout as fsdp2 writes it at 8 ranks: every tensor ``Shard(0)`` over 8 ranks, one
      ``__<rank>_0.distcp`` file per rank, the flattened optimizer keys. Each rank's part is written by DCP itself
      (``dcp.save`` of DTensors on an 8-rank mesh of torch's fake process group, one rank at a time so that only one
      rank's shards are in memory), and the eight ``.metadata`` files are merged into one as DCP's coordinator does.
Consolidation runs in a fresh process; its peak resident memory (``ru_maxrss``) above the resident memory after the
imports is the figure, printed beside the full weights, the largest tensor and the optimizer state on disk.

    python benchmarks/bench_consolidate.py [--params 1e9] [--skip-gpt] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightscale.checkpoint.portable import TRAINER_STATE
from lightscale.storage.safe_io import save_atomically

MEASURE = """
import json, resource, sys
from lightscale.commands.consolidate import consolidate
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
base = rss()
consolidate(sys.argv[1], sys.argv[2])
print(json.dumps({"base": base, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""
MiB = 2**20


# ---- the small GPT, saved by fsdp2 ------------------------------------------------------------------------------
def _train_gpt(directory: str) -> None:
    import lightscale
    from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule

    config = GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384)
    trainer = lightscale.Trainer(
        strategy="fsdp2",
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(GPTModule(config), GPTDataModule(block_size=256, batch_size=2))
    trainer.save_checkpoint(Path(directory) / "gpt.ckpt")


# ---- a synthetic 1B layout at 8 ranks ---------------------------------------------------------------------------
def layer_shapes(params: float) -> dict[str, tuple[int, ...]]:
    """A GPT-like model of about ``params`` parameters: width 2048, a 32000-token embedding, blocks until full."""
    width, vocab = 2048, 32000
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (vocab, width)}
    block = {
        "attention.wqkv.weight": (3 * width, width),
        "attention.wo.weight": (width, width),
        "feed_forward.w1.weight": (4 * width, width),
        "feed_forward.w2.weight": (width, 4 * width),
        "attention_norm.weight": (width,),
        "ffn_norm.weight": (width,),
    }
    per_block = sum(torch.Size(shape).numel() for shape in block.values())
    for index in range(max(1, round((params - vocab * width) / per_block))):
        shapes |= {f"layers.{index}.{name}": shape for name, shape in block.items()}
    return shapes | {"norm.weight": (width,)}


def _rank_state(shapes: dict[str, tuple[int, ...]], mesh: object) -> dict:
    """One rank's state as lightscale's fsdp2 saves it: DTensor shards of weights and Adam moments."""
    from torch.distributed.tensor import DTensor, Shard

    def shard(shape: tuple[int, ...]) -> DTensor:
        rows = torch.Size(shape)[0]
        mine = torch.tensor_split(torch.arange(rows), 8)[dist.get_rank()].numel()
        local = torch.ones((mine, *shape[1:]))  # values do not matter for memory; ones are cheap to make
        return DTensor.from_local(
            local, mesh, [Shard(0)], shape=torch.Size(shape), stride=_stride(shape), run_check=False
        )

    model = {f"model.{name}": shard(shape) for name, shape in shapes.items()}
    optimizer: dict = {}
    for name, shape in shapes.items():
        optimizer |= {f"state.model.{name}.exp_avg": shard(shape), f"state.model.{name}.exp_avg_sq": shard(shape)}
        optimizer[f"state.model.{name}.step"] = torch.tensor(1.0)
        optimizer |= {f"param_groups.model.{name}.{key}": value for key, value in (("lr", 1e-3), ("eps", 1e-8))}
    return {"model": {k[len("model.") :]: v for k, v in model.items()}, "optimizer": optimizer}


def _stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return torch.empty(0).new_empty(shape, device="meta").stride()


def write_synthetic_layout(directory: Path, params: float) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    shapes = layer_shapes(params)
    parts = []
    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        part = directory.with_name(f"{directory.name}.rank{rank}")
        dcp.save(_rank_state(shapes, init_device_mesh("cpu", (8,))), checkpoint_id=str(part), no_dist=True)
        dist.destroy_process_group()
        parts.append(part)
    _merge(parts, directory)
    rest = {
        "hyper_parameters": {},
        "pytorch-lightning_version": "2.6.6",
        "global_step": 1,
        "lightscale": {"format": 1, "strategy": "synthetic FSDP2Strategy", "world_size": 8},
    }
    save_atomically(rest, directory / TRAINER_STATE)


def _merge(parts: list[Path], directory: Path) -> None:
    """The eight single-rank DCP directories as one 8-rank checkpoint: data files renamed per rank, the chunks of
    every sharded tensor listed together (replicated entries once), as DCP's coordinator writes ``.metadata``."""
    directory.mkdir(parents=True)
    merged: Metadata | None = None
    for rank, part in enumerate(parts):
        with open(part / ".metadata", "rb") as file:
            metadata = pickle.load(file)  # written by this script a moment ago
        for data in part.glob("*.distcp"):
            data.rename(directory / f"__{rank}_0.distcp")
        for info in metadata.storage_data.values():
            info.relative_path = f"__{rank}_0.distcp"
        if merged is None:
            merged = metadata
        else:
            for key, meta in metadata.state_dict_metadata.items():
                if isinstance(meta, TensorStorageMetadata) and len(meta.chunks) and meta.size != meta.chunks[0].sizes:
                    merged.state_dict_metadata[key].chunks.extend(meta.chunks)
                    merged.storage_data |= {i: s for i, s in metadata.storage_data.items() if i.fqn == key}
        shutil.rmtree(part)
    with open(directory / ".metadata", "wb") as file:
        pickle.dump(merged, file)


# ---- measuring ----------------------------------------------------------------------------------------------------
def sizes(directory: Path) -> dict[str, int]:
    from lightscale.checkpoint.portable import layout_entries

    entries = layout_entries(directory)
    tensors = {
        k: m.size.numel() * m.properties.dtype.itemsize
        for k, m in entries.items()
        if isinstance(m, TensorStorageMetadata)
    }
    model = {k: v for k, v in tensors.items() if k.startswith("model.")}
    return {
        "weights": sum(model.values()),
        "largest": max(model.values()),
        "optimizer": sum(v for k, v in tensors.items() if k.startswith("optimizer.")),
    }


def measure(directory: Path) -> dict[str, int]:
    out = directory.with_name(directory.name + ".consolidated.ckpt")
    done = subprocess.run([sys.executable, "-c", MEASURE, str(directory), str(out)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    out.unlink()
    return {**sizes(directory), "peak_above_imports": result["peak"] - result["base"]}


def report(name: str, figures: dict[str, int]) -> None:
    peak, weights = figures["peak_above_imports"], figures["weights"]
    print(
        f"{name}: peak while consolidating {peak / MiB:,.1f} MiB = {peak / weights:.2f} x the full weights "
        f"({weights / MiB:,.1f} MiB; largest tensor {figures['largest'] / MiB:,.1f} MiB; optimizer state on disk, "
        f"not read: {figures['optimizer'] / MiB:,.1f} MiB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=1e9, help="parameters of the synthetic 8-rank layout")
    parser.add_argument("--skip-gpt", action="store_true")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        if not args.skip_gpt:
            from lightscale.testing import run_distributed

            run_distributed(_train_gpt, root, world_size=2, timeout_s=600)
            report("small GPT, fsdp2 at 2 ranks", measure(Path(root) / "gpt.ckpt"))
        synthetic = Path(root) / "synthetic.ckpt"
        write_synthetic_layout(synthetic, args.params)
        report(f"synthetic {args.params:.2g}-parameter layout, fsdp2 at 8 ranks", measure(synthetic))


if __name__ == "__main__":
    main()

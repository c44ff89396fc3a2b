"""Data for the GPT recipe: text -> byte tokens -> cached uint16 memmap -> fixed windows -> a sharded stream.

The default corpus ships with every CPython (``pydoc_data``), so the recipe runs offline with no downloads.

Example:
    >>> dm = GPTDataModule(block_size=64, batch_size=4)
    >>> dm.prepare_data(); dm.setup("fit")
    >>> x, y = next(iter(dm.train_dataloader()))  # int64 [4, 64] each; y is x shifted by one token
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from lightscale.errors import ConfigurationError
from lightscale.strategies.sampler import position_in_epoch

TOKEN_DTYPE = np.uint16  # half the disk of int32; fits any vocabulary up to 65,536


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, tokens: np.ndarray | list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary file, no training, every string round-trips."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, tokens: np.ndarray | list[int]) -> str:
        return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def default_corpus() -> str:
    """The help texts CPython ships in ``pydoc_data`` (~460 KB of English prose and code), sorted by topic."""
    try:
        from pydoc_data.topics import topics
    except ImportError as err:  # some distro builds strip it
        raise RuntimeError(
            "the default corpus needs the stdlib module pydoc_data, which this Python lacks; "
            "pass text_files=[...] to GPTDataModule instead"
        ) from err
    return "\n\n".join(topics[key] for key in sorted(topics))


def default_cache_dir() -> Path:
    return Path(os.environ.get("LIGHTSCALE_CACHE", Path.home() / ".cache" / "lightscale"))


def read_corpus(texts: list[str] | None) -> str:
    if texts is None:
        return default_corpus()
    missing = [path for path in texts if not Path(path).is_file()]
    if missing:
        raise FileNotFoundError(f"text_files not found: {missing}")
    return "\n\n".join(Path(path).read_text(encoding="utf-8") for path in texts)


def tokenize_to_memmap(texts: list[str] | None, cache_dir: Path, tokenizer: Tokenizer) -> Path:
    """Tokenize ``texts`` (file paths; the default corpus when None) into ``cache_dir/<name>-<hash>.bin``.

    The name hashes the text and the tokenizer, so a cached file is reused only for identical inputs. The file is
    written to a temporary name and renamed, so concurrent ranks or runs never read a half-written file.
    """
    if tokenizer.vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"vocab_size={tokenizer.vocab_size} does not fit in {np.dtype(TOKEN_DTYPE).name} tokens")
    text = read_corpus(texts)
    digest = hashlib.sha256(f"{type(tokenizer).__name__}:{tokenizer.vocab_size}\0".encode())
    digest.update(text.encode("utf-8"))
    cache_dir = Path(cache_dir)
    path = cache_dir / f"tokens-{digest.hexdigest()[:20]}.bin"
    if path.exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    tokens = tokenizer.encode(text).astype(TOKEN_DTYPE)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(tokens.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic within one file system, hence the temp file sits in cache_dir
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class TokenWindows(Dataset):
    """Non-overlapping windows: item ``i`` is ``(tokens[iT:(i+1)T], tokens[iT+1:(i+1)T+1])`` as int64."""

    def __init__(self, tokens: np.ndarray, block_size: int) -> None:
        if len(tokens) < block_size + 1:
            raise ValueError(f"{len(tokens)} tokens cannot fill one window of block_size={block_size} (+1 target)")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        chunk = torch.from_numpy(np.asarray(self.tokens[start : start + self.block_size + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]


class StreamSampler(DistributedSampler):
    """Deterministic data-parallel sharding that never drops or repeats a sample over a run.

    The sample stream is permutation 0, permutation 1, ... of ``range(N)`` (permutation ``k`` seeded with
    ``seed + k``; identity order without shuffle). An epoch is ``N // global_batch`` global batches and epoch
    ``e`` starts where epoch ``e - 1`` stopped, so the leftover samples open the next epoch instead of being
    dropped. Rank ``r`` takes slice ``[r*b, (r+1)*b)`` of every global batch, so the ranks' batches concatenated
    by rank equal the single-process batch of size ``R*b``: losses match across data-parallel degrees.
    It subclasses ``DistributedSampler`` only so Lightning keeps it instead of injecting its own.

    Example:
        >>> sampler = StreamSampler(range(10), batch_size=2, num_replicas=2, rank=1, shuffle=False)
        >>> list(sampler), len(sampler)
        ([2, 3, 6, 7], 4)
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        roll_over: bool = True,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.batch_size = batch_size
        self.global_batch = batch_size * num_replicas
        self.num_items = len(dataset)  # type: ignore[arg-type]
        if self.num_items < self.global_batch:
            raise ValueError(
                f"dataset has {self.num_items} samples, fewer than one global batch of {self.global_batch} "
                f"(batch_size={batch_size} x num_replicas={num_replicas}); use more data, a smaller batch_size "
                "or a smaller block_size"
            )
        self.batches_per_epoch = self.num_items // self.global_batch
        # Without roll-over every epoch reads the same batches (validation: comparable losses across epochs).
        self.roll_over = roll_over
        self.resume_epoch, self.resume_batches = 0, 0

    def resume_from(self, epoch: int, batches_done: int) -> None:
        """Skip the ``batches_done`` local batches of ``epoch`` already trained on (resuming mid-epoch)."""
        self.resume_epoch, self.resume_batches = epoch, batches_done

    def _permutation(self, k: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_items)
        generator = torch.Generator().manual_seed(self.seed + k)
        return torch.randperm(self.num_items, generator=generator).numpy()

    def stream(self, positions: np.ndarray) -> np.ndarray:
        """Sample indices at absolute stream ``positions``."""
        out = np.empty_like(positions)
        perm_ids = positions // self.num_items
        for k in np.unique(perm_ids):  # one epoch spans at most two permutations
            mask = perm_ids == k
            out[mask] = self._permutation(int(k))[positions[mask] % self.num_items]
        return out

    def local_positions(self) -> np.ndarray:
        epoch = self.epoch if self.roll_over else 0
        start = epoch * self.batches_per_epoch * self.global_batch
        first = self.resume_batches if epoch == self.resume_epoch else 0
        batch_starts = (
            start + np.arange(first, self.batches_per_epoch) * self.global_batch + self.rank * self.batch_size
        )
        return (batch_starts[:, None] + np.arange(self.batch_size)[None, :]).reshape(-1)

    @override
    def __iter__(self) -> Iterator[int]:
        return iter(self.stream(self.local_positions()).tolist())

    @override
    def __len__(self) -> int:
        return self.batches_per_epoch * self.batch_size  # the whole epoch, also when resuming inside it

    @override
    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class GPTDataModule(pl.LightningDataModule):
    """Byte-level language-model data over ``text_files`` (default: CPython's ``pydoc_data`` help texts).

    ``batch_size`` is the per data-parallel-rank micro-batch (Lightning convention); the global batch is
    ``batch_size * num_replicas``. Tokens split into train (first ``1 - val_fraction``) and validation (rest).
    Training streams through :class:`StreamSampler` (nothing dropped or repeated across epochs). Validation
    (and test, which reuses the validation split) covers the first ``floor(N / global_batch)`` global batches
    of its ``N`` windows in order, the same batches every epoch; the last ``N mod global_batch`` are skipped.
    """

    def __init__(
        self,
        text_files: list[str] | None = None,
        *,
        block_size: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.1,
        seed: int = 1234,
        shuffle: bool = True,
        num_workers: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if block_size <= 0 or batch_size <= 0:
            raise ValueError(f"block_size and batch_size must be positive, got {block_size} and {batch_size}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if isinstance(text_files, str):  # a lone path would otherwise be read character by character
            raise TypeError(f"text_files must be a list of paths, got the string {text_files!r}; wrap it in [...]")
        missing = [str(path) for path in text_files or [] if not Path(path).is_file()]
        if missing:  # at construction: a typo fails before any process starts, not in prepare_data
            raise ConfigurationError(
                f"GPTDataModule(text_files=...): no such file {missing}. Valid: existing text files, or "
                "text_files=None for the default corpus."
            )
        self.save_hyperparameters()
        self.text_files = text_files
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.tokenizer = ByteTokenizer()
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    @override
    def prepare_data(self) -> None:
        tokenize_to_memmap(self.text_files, self.cache_dir, self.tokenizer)

    @override
    def setup(self, stage: str) -> None:
        path = tokenize_to_memmap(self.text_files, self.cache_dir, self.tokenizer)  # cached: only hashes the text
        tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
        split = int(len(tokens) * (1.0 - self.val_fraction))
        self.train_set = TokenWindows(tokens[:split], self.block_size)
        self.val_set = TokenWindows(tokens[split:], self.block_size)

    def replicas(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` of data parallelism, from the attached trainer's strategy when there is one."""
        trainer = getattr(self, "trainer", None)
        # Only parallel strategies define distributed_sampler_kwargs; single-device ones lack the attribute.
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
        if kwargs is None:
            return 1, 0
        return kwargs["num_replicas"], kwargs["rank"]

    def _loader(self, dataset: TokenWindows | None, *, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("GPTDataModule.setup() must run before asking for a dataloader")
        num_replicas, rank = self.replicas()
        sampler = StreamSampler(
            dataset,
            batch_size=self.batch_size,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=self.shuffle and train,
            seed=self.seed,
            roll_over=train,
        )
        if train:
            sampler.resume_from(*position_in_epoch(getattr(self, "trainer", None)))
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

"""Data for the GPT recipe: text -> tokens -> cached memmap -> fixed windows -> a sharded stream.

The default corpus ships with every CPython (``pydoc_data``), so the recipe runs offline with no downloads. Text is
tokenized by bytes or by a local ``tokenizer.json``; token files other tools wrote (nanoGPT, llm.c, litdata) are read
as they are (token_files.py).

Example:
    >>> dm = GPTDataModule(block_size=64, batch_size=4)
    >>> dm.prepare_data(); dm.setup("fit")
    >>> x, y = next(iter(dm.train_dataloader()))  # int64 [4, 64] each; y is x shifted by one token
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from lightscale.data.data_shard import DataShard, data_shard
from lightscale.data.sampler import position_in_epoch
from lightscale.errors import ConfigurationError
from lightscale.recipes.gpt.token_files import (
    BPETokenizer,
    TokenWindows,
    check_token_format,
    open_token_dir,
    token_dir_vocab,
    write_atomically,
)


class Tokenizer(Protocol):
    vocab_size: int
    fingerprint: str  # names the token cache: equal fingerprints must encode equally

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, tokens: np.ndarray | list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary file, no training, every string round-trips."""

    vocab_size = 256
    fingerprint = "ByteTokenizer:256"

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


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 where the vocabulary fits (half the disk), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


def tokenize_to_memmap(texts: list[str] | None, cache_dir: Path, tokenizer: Tokenizer) -> Path:
    """Tokenize ``texts`` (file paths; the default corpus when None) into ``cache_dir/<name>-<hash>.bin``.

    The name hashes the text and the tokenizer, so a cached file is reused only for identical inputs. The file is
    written to a temporary name and renamed, so concurrent ranks or runs never read a half-written file.
    """
    text = read_corpus(texts)
    digest = hashlib.sha256(f"{tokenizer.fingerprint}\0".encode())
    digest.update(text.encode("utf-8"))
    path = Path(cache_dir) / f"tokens-{digest.hexdigest()[:20]}.bin"
    if not path.exists():
        write_atomically(path, [tokenizer.encode(text).astype(token_dtype(tokenizer.vocab_size)).tobytes()])
    return path


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
    """Language-model data: ``text_files`` (default: CPython's ``pydoc_data`` help texts) or a ``data_dir`` of tokens.

    Text is tokenized by UTF-8 bytes, or by ``tokenizer`` (a local ``tokenizer.json``, the ``tokenizers`` package).
    ``data_dir`` holds ``train.bin``/``val.bin`` as nanoGPT or llm.c write them (``token_format``: ``auto`` reads
    llm.c's header when there is one) or litdata-optimized ``train/`` and ``val/`` directories; ``val_fraction`` is
    then unused. ``python -m lightscale.recipes.gpt.prepare`` writes such a directory from text.

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
        data_dir: str | None = None,
        tokenizer: str | None = None,
        token_format: str = "auto",
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
        if text_files is not None and data_dir is not None:
            raise ConfigurationError(
                f"GPTDataModule got text_files={text_files} and data_dir={data_dir!r}; valid: one of them (text is "
                "tokenized here, a data_dir holds tokens already)."
            )
        check_token_format(token_format)
        self.save_hyperparameters()
        self.text_files = text_files
        self.data_dir = data_dir
        self.token_format = token_format
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.tokenizer: Tokenizer | None = BPETokenizer(tokenizer) if tokenizer is not None else None
        if self.tokenizer is None and data_dir is None:
            self.tokenizer = ByteTokenizer()
        # The vocabulary the data draws from (GPTModule refuses a smaller model): the tokenizer's, else read from
        # the token files at setup (None for litdata without a tokenizer).
        self.vocab_size: int | None = self.tokenizer.vocab_size if self.tokenizer is not None else None
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    @override
    def prepare_data(self) -> None:
        if self.data_dir is None:
            tokenize_to_memmap(self.text_files, self.cache_dir, self.tokenizer)

    @override
    def setup(self, stage: str) -> None:
        if self.data_dir is not None:
            splits = open_token_dir(self.data_dir, block_size=self.block_size, token_format=self.token_format)
            self.train_set, self.val_set = splits["train"], splits["val"]
            if self.vocab_size is None:
                self.vocab_size = token_dir_vocab(splits)
            return
        path = tokenize_to_memmap(self.text_files, self.cache_dir, self.tokenizer)  # cached: only hashes the text
        tokens = np.memmap(path, dtype=token_dtype(self.tokenizer.vocab_size), mode="r")
        split = int(len(tokens) * (1.0 - self.val_fraction))
        self.train_set = TokenWindows(tokens[:split], self.block_size, source="the training split")
        self.val_set = TokenWindows(tokens[split:], self.block_size, source="the validation split")

    def replicas(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` of data parallelism, from the attached trainer's strategy when there is one."""
        trainer = getattr(self, "trainer", None)
        index, count = data_shard(trainer) if trainer is not None else DataShard(0, 1)
        return count, index

    def _loader(self, dataset: Dataset | None, *, train: bool) -> DataLoader:
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

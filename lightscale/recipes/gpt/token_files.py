"""Tokens other tools already wrote: nanoGPT's ``train.bin``, llm.c's headed shards, litdata-optimized directories.

* nanoGPT (``data/*/prepare.py``): raw little-endian uint16 tokens, nothing else.
* llm.c (``dev/data/data_common.py``): 256 int32 of header (magic 20240520, version 1 = uint16 tokens or
  2 = uint32, token count), then the tokens.
* litdata (``litdata.optimize(..., item_loader=TokensLoader())``, litgpt's pre-training layout): ``train/`` and
  ``val/`` directories, read as windows of ``block_size + 1`` tokens.

Token files are memory-mapped (no copy); every format is checked before a step runs (magic, version, length).

Example:
    >>> write_token_file("data/train.bin", tokens)  # llm.c layout; token_format="nanogpt" for raw uint16
    >>> read_token_file("data/train.bin")  # np.memmap of the tokens, the format read from the header
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset

from lightscale.errors import ConfigurationError, import_extra
from lightscale.storage.safe_io import atomic_path

LLMC_MAGIC = 20240520
LLMC_HEADER_BYTES = 256 * 4
LLMC_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}  # llm.c's version number -> token dtype
NANOGPT_DTYPE = np.dtype("<u2")
TOKEN_FORMATS = ("auto", "nanogpt", "llmc")
PREPARE = "python -m lightscale.recipes.gpt.prepare --out DIR [--tokenizer tokenizer.json] [text files]"


def check_token_format(token_format: str) -> None:
    if token_format not in TOKEN_FORMATS:
        raise ConfigurationError(f"token_format={token_format!r} is not valid; choose one of {list(TOKEN_FORMATS)}.")


def read_token_file(path: str | Path, *, token_format: str = "auto") -> np.memmap:
    """The tokens of a nanoGPT or llm.c file as a read-only memmap; ``auto`` reads the format from the header."""
    path = Path(path)
    check_token_format(token_format)
    size = path.stat().st_size
    header = np.fromfile(path, dtype="<i4", count=3) if size >= LLMC_HEADER_BYTES else np.zeros(3, dtype="<i4")
    headed = int(header[0]) == LLMC_MAGIC
    if token_format == "llmc" or (token_format == "auto" and headed):
        return _read_llmc(path, header, size)
    if headed:
        raise ConfigurationError(
            f"{path} starts with llm.c's magic {LLMC_MAGIC} but token_format='nanogpt' reads it as raw uint16 "
            "tokens (the header would become tokens). Valid: token_format='llmc' or 'auto'."
        )
    if size % NANOGPT_DTYPE.itemsize:
        raise ConfigurationError(
            f"{path} has {size} bytes, not a whole number of uint16 tokens: not a nanoGPT token file. Valid: raw "
            f"uint16 tokens (nanoGPT) or an llm.c file (header with magic {LLMC_MAGIC})."
        )
    return np.memmap(path, dtype=NANOGPT_DTYPE, mode="r")


def _read_llmc(path: Path, header: np.ndarray, size: int) -> np.memmap:
    magic, version, count = (int(value) for value in header)
    if magic != LLMC_MAGIC:
        raise ConfigurationError(
            f"{path} has magic {magic}, not llm.c's {LLMC_MAGIC}: not an llm.c token file. Valid: a file written by "
            "llm.c or write_token_file, or token_format='nanogpt' (or 'auto') for raw uint16 tokens."
        )
    if version not in LLMC_DTYPES:
        raise ConfigurationError(
            f"{path} has llm.c version {version}; valid versions: 1 (uint16 tokens) and 2 (uint32 tokens)."
        )
    dtype = LLMC_DTYPES[version]
    if count < 0 or LLMC_HEADER_BYTES + count * dtype.itemsize > size:
        raise ConfigurationError(
            f"{path} claims {count} {dtype.name} tokens in its header but holds "
            f"{(size - LLMC_HEADER_BYTES) // dtype.itemsize}: the file is truncated or the header is wrong."
        )
    return np.memmap(path, dtype=dtype, mode="r", offset=LLMC_HEADER_BYTES, shape=(count,))


def write_token_file(path: str | Path, tokens: np.ndarray, *, token_format: str = "llmc") -> Path:
    """Write ``tokens`` as llm.c (uint16, or uint32 past 65,535) or nanoGPT (uint16) reads them, atomically."""
    tokens = np.asarray(tokens)
    top = int(tokens.max()) if tokens.size else 0
    if token_format == "nanogpt":
        if top > np.iinfo(np.uint16).max:
            raise ConfigurationError(f"token {top} does not fit nanoGPT's uint16 files; use token_format='llmc'.")
        return write_atomically(path, [tokens.astype(NANOGPT_DTYPE).tobytes()])
    if token_format != "llmc":
        raise ConfigurationError(f"token_format={token_format!r} cannot be written; choose 'llmc' or 'nanogpt'.")
    version = 1 if top <= np.iinfo(np.uint16).max else 2
    header = np.zeros(LLMC_HEADER_BYTES // 4, dtype="<i4")
    header[:3] = LLMC_MAGIC, version, len(tokens)
    return write_atomically(path, [header.tobytes(), tokens.astype(LLMC_DTYPES[version]).tobytes()])


def write_atomically(path: str | Path, parts: Iterable[bytes]) -> Path:
    """Write ``parts`` through :func:`atomic_path` (a file beside ``path``, renamed), so no reader sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as partial, open(partial, "wb") as file:
        file.writelines(parts)
    return path


def max_token(tokens: np.ndarray, *, chunk: int = 1 << 24) -> int:
    """The largest token, read in chunks so a memmap of billions of tokens is never copied whole."""
    return max((int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk)), default=-1)


class TokenWindows(Dataset):
    """Non-overlapping windows: item ``i`` is ``(tokens[iT:(i+1)T], tokens[iT+1:(i+1)T+1])`` as int64."""

    def __init__(self, tokens: np.ndarray, block_size: int, *, source: str = "the tokens") -> None:
        if len(tokens) < block_size + 1:
            raise ConfigurationError(
                f"{source}: {len(tokens)} tokens cannot fill one window of block_size={block_size} (+1 target). "
                f"Valid: at least {block_size + 1} tokens, or a smaller block_size."
            )
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        chunk = torch.from_numpy(np.asarray(self.tokens[start : start + self.block_size + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]


class LitdataWindows(Dataset):
    """A litdata-optimized directory of tokens (``TokensLoader``) as windows of ``block_size + 1`` tokens.

    Read by index (map-style), so the recipe's sampler shards and resumes it as it does token files; litdata's own
    distributed split is not used. Item ``i`` is the ``i``-th window of ``block_size + 1`` tokens as litgpt reads it.
    """

    def __init__(self, input_dir: str | Path, block_size: int) -> None:
        litdata = import_extra("litdata", "litdata")
        self.input_dir = str(input_dir)
        self.block_size = block_size
        self.stream = litdata.StreamingDataset(self.input_dir, item_loader=litdata.TokensLoader(block_size + 1))
        self.stream[0]  # opens the index: the cache below then counts the whole directory, not one rank's share
        self.length = len(self.stream.cache)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.stream[index].to(torch.int64)
        return window[:-1], window[1:]


class BPETokenizer:
    """A Hugging Face ``tokenizers`` tokenizer from a local ``tokenizer.json`` (never downloads).

    Example:
        >>> BPETokenizer("gpt2/tokenizer.json").encode("hello")  # array([31373], dtype=uint32)
    """

    def __init__(self, path: str | Path) -> None:
        tokenizers = import_extra("tokenizers", "data")
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigurationError(f"tokenizer={str(path)!r}: no such file. Valid: a local tokenizer.json.")
        self._tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        self.vocab_size: int = self._tokenizer.get_vocab_size()
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]
        self.fingerprint = f"BPETokenizer:{self.vocab_size}:{digest}"  # names the token cache

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text).ids, dtype=np.uint32)

    def decode(self, tokens: np.ndarray | list[int]) -> str:
        return self._tokenizer.decode(np.asarray(tokens).tolist())


def open_token_dir(data_dir: str | Path, *, block_size: int, token_format: str = "auto") -> dict[str, Dataset]:
    """``{"train": ..., "val": ...}`` windows of a directory of token files or of a litdata-optimized directory.

    Token files: ``*train*.bin`` and ``*val*.bin`` (nanoGPT's ``train.bin``/``val.bin``, llm.c's numbered shards),
    each file cut into its own windows (none spans two files). litdata: ``train/`` and ``val/`` with ``index.json``,
    read where there are no token files.
    """
    root = Path(data_dir)
    files = {split: sorted(root.glob(f"*{split}*.bin")) for split in ("train", "val")}
    if not all(files.values()) and all((root / split / "index.json").is_file() for split in ("train", "val")):
        return {split: LitdataWindows(root / split, block_size) for split in ("train", "val")}
    if not root.is_dir() or not all(files.values()):
        found = sorted(p.name for p in root.iterdir()) if root.is_dir() else "no such directory"
        raise ConfigurationError(
            f"data_dir={str(data_dir)!r} holds no token data ({found}). Valid: train.bin and val.bin (nanoGPT or "
            f"llm.c token files; llm.c shards *train*.bin / *val*.bin), or litdata-optimized train/ and val/ "
            f"directories. Write them with: {PREPARE}"
        )
    return {
        split: ConcatDataset(
            [TokenWindows(read_token_file(p, token_format=token_format), block_size, source=str(p)) for p in paths]
        )
        for split, paths in files.items()
    }


def token_dir_vocab(splits: dict[str, Dataset]) -> int | None:
    """One more than the largest token of token-file splits (read once, in chunks); None for litdata."""
    windows = [w for split in splits.values() if isinstance(split, ConcatDataset) for w in split.datasets]
    return 1 + max(max_token(w.tokens) for w in windows) if windows else None

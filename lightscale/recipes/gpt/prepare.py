"""Write ``train.bin``/``val.bin`` (and optionally litdata-optimized ``train/``/``val/``) from text, offline.

The split is the one ``GPTDataModule(text_files=..., tokenizer=...)`` makes (the first ``1 - val_fraction`` of the
tokens train), so the files hold exactly the tokens the text path would train on.

Example:
    python -m lightscale.recipes.gpt.prepare --out data/gpt2 --tokenizer gpt2/tokenizer.json corpus.txt
    lightscale fit --config gpt/gpt2-124m_ddp.yaml --data.data_dir data/gpt2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from lightscale.errors import import_extra
from lightscale.recipes.gpt.data import ByteTokenizer, Tokenizer, read_corpus
from lightscale.recipes.gpt.token_files import BPETokenizer, read_token_file, write_token_file

LITDATA_CHUNK_TOKENS = 1 << 22  # tokens per litdata chunk file (16 MiB of int32)


def prepare(
    out: str | Path,
    text_files: list[str] | None = None,
    *,
    tokenizer: str | None = None,
    val_fraction: float = 0.1,
    token_format: str = "llmc",
    litdata: bool = False,
) -> dict[str, Path]:
    """Tokenize ``text_files`` (the default corpus when None) into ``out``; returns the written paths by split."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tok: Tokenizer = BPETokenizer(tokenizer) if tokenizer is not None else ByteTokenizer()
    tokens = tok.encode(read_corpus(text_files))
    split = int(len(tokens) * (1.0 - val_fraction))
    out = Path(out)
    written = {
        name: write_token_file(out / f"{name}.bin", part, token_format=token_format)
        for name, part in (("train", tokens[:split]), ("val", tokens[split:]))
    }
    if litdata:
        for name, path in written.items():
            write_litdata(path, out / name)
    return written


def write_litdata(token_file: Path, output_dir: Path) -> None:
    """The tokens of ``token_file`` as a litdata-optimized directory (``TokensLoader``, the layout litgpt reads).

    litdata's ``Cache`` writer in this process (``litdata.optimize`` writes the same files through worker
    processes, which a few million tokens do not need).
    """
    streaming = import_extra("litdata.streaming", "litdata")
    litdata = import_extra("litdata", "litdata")
    if (output_dir / "index.json").exists():
        raise FileExistsError(f"{output_dir} already holds a litdata index; remove it to write it again")
    tokens = read_token_file(token_file)
    cache = streaming.Cache(str(output_dir), chunk_size=LITDATA_CHUNK_TOKENS + 1, item_loader=litdata.TokensLoader())
    for index, start in enumerate(range(0, len(tokens), LITDATA_CHUNK_TOKENS)):
        chunk = np.asarray(tokens[start : start + LITDATA_CHUNK_TOKENS], dtype=np.int32)
        cache[index] = torch.from_numpy(chunk)
    cache.done()
    cache.merge()


def main(argv: list[str] | None = None) -> None:
    prog = "python -m lightscale.recipes.gpt.prepare"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("text_files", nargs="*", help="UTF-8 text files (default: the embedded pydoc_data corpus)")
    parser.add_argument("--out", required=True, help="directory for train.bin and val.bin")
    parser.add_argument("--tokenizer", help="a local tokenizer.json (default: UTF-8 bytes)")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--format", choices=["llmc", "nanogpt"], default="llmc", help="llm.c header or raw uint16")
    parser.add_argument("--litdata", action="store_true", help="also write litdata-optimized train/ and val/")
    args = parser.parse_args(argv)
    written = prepare(
        args.out,
        args.text_files or None,
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        token_format=args.format,
        litdata=args.litdata,
    )
    for name, path in written.items():
        print(f"{name}: {len(read_token_file(path)):,} tokens -> {path}")


if __name__ == "__main__":
    main()

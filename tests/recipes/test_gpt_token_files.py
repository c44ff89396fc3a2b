"""GPT token files: nanoGPT/llm.c/litdata data trains on exactly the tokens the text path would, bad files refused."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lightscale.errors import ConfigurationError
from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule
from lightscale.recipes.gpt.data import default_corpus
from lightscale.recipes.gpt.prepare import main as prepare_main
from lightscale.recipes.gpt.token_files import BPETokenizer, read_token_file, write_token_file

VOCAB = 320  # 256 byte-level symbols + 64 merges: small enough to train in well under a second


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    """(a 40 kB text file, a tiny BPE tokenizer.json trained on the embedded corpus with tokenizers' trainer)."""
    root = tmp_path_factory.mktemp("bpe")
    text = default_corpus()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator([text[:60_000]], trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "corpus.txt").write_text(text[100_000:140_000], encoding="utf-8")
    return str(root / "corpus.txt"), str(root / "tokenizer.json")


def test_bpe_tokenizer_roundtrips(corpus):
    tok = BPETokenizer(corpus[1])
    assert tok.vocab_size == VOCAB
    ids = tok.encode("def f(x): return x  # ok")
    assert ids.dtype == np.uint32 and ids.max() < VOCAB and len(ids) < 25  # merges make it shorter than bytes
    assert tok.decode(ids) == "def f(x): return x  # ok"


def run_losses(data: GPTDataModule, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    """Train a tiny GPT on one CPU process (fixed seed); the losses and batches of every step."""

    class Record(pl.Callback):
        losses: list[float] = []
        batches: list[torch.Tensor] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(outputs["loss"].item())
            self.batches.append(batch[0].clone())

    pl.seed_everything(0, verbose=False)
    record = Record()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[record],
    )
    config = GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=1, n_head=2, n_embd=32)
    trainer.fit(GPTModule(config, learning_rate=3e-3), data)
    return record.losses, record.batches


@pytest.mark.parametrize("token_format", ["llmc", "nanogpt"])
def test_token_files_train_like_the_text_path(corpus, tmp_path, token_format):
    text, tokenizer = corpus
    kwargs = {"block_size": 32, "batch_size": 4, "seed": 3}
    prepare_main(["--out", str(tmp_path / "data"), "--tokenizer", tokenizer, "--format", token_format, text])
    from_text = GPTDataModule([text], tokenizer=tokenizer, cache_dir=str(tmp_path / "cache"), **kwargs)
    from_files = GPTDataModule(data_dir=str(tmp_path / "data"), **kwargs)
    losses_text, batches_text = run_losses(from_text)
    losses_files, batches_files = run_losses(from_files)
    assert len(from_text.train_set) == len(from_files.train_set) and len(from_text.val_set) == len(from_files.val_set)
    assert all(torch.equal(a, b) for a, b in zip(batches_text, batches_files, strict=True))
    assert batches_text[0].max() >= 256  # BPE merges are in the batches, not bytes only
    assert losses_text == losses_files and len(losses_text) == 3
    assert from_files.vocab_size == 1 + max(int(read_token_file(p).max()) for p in (tmp_path / "data").glob("*.bin"))


def test_litdata_directory_reads_litgpt_windows(corpus, tmp_path):
    text, tokenizer = corpus
    prepare_main(["--out", str(tmp_path), "--tokenizer", tokenizer, "--litdata", text])
    for split in ("train", "val"):  # token files are read first where both exist
        (tmp_path / f"{split}.bin").rename(tmp_path / f"{split}.tokens")
    data = GPTDataModule(data_dir=str(tmp_path), tokenizer=tokenizer, block_size=32, batch_size=4)
    data.setup("fit")
    tokens = np.asarray(read_token_file(tmp_path / "train.tokens"), dtype=np.int64)
    assert len(data.train_set) == len(tokens) // 33  # windows of block_size + 1, as litgpt reads them
    for i in (0, 7, len(data.train_set) - 1):
        x, y = data.train_set[i]
        assert (
            x.tolist() == tokens[33 * i : 33 * i + 32].tolist()
            and y.tolist() == tokens[33 * i + 1 : 33 * i + 33].tolist()
        )
    assert data.vocab_size == VOCAB
    x, _ = next(iter(data.train_dataloader()))
    assert x.shape == (4, 32) and x.dtype == torch.int64


def test_llmc_uint32_tokens_and_shards(tmp_path):
    big = np.array([0, 70_000, 5, 65_536, 1, 2, 3, 4, 5], dtype=np.uint32)  # version 2: past uint16
    write_token_file(tmp_path / "fineweb_train_000001.bin", big)
    write_token_file(tmp_path / "fineweb_train_000002.bin", big[::-1])
    write_token_file(tmp_path / "fineweb_val_000000.bin", big)
    assert np.fromfile(tmp_path / "fineweb_val_000000.bin", dtype="<i4", count=3).tolist() == [20240520, 2, 9]
    tokens = read_token_file(tmp_path / "fineweb_val_000000.bin")
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint32 and tokens.tolist() == big.tolist()
    data = GPTDataModule(data_dir=str(tmp_path), block_size=4, batch_size=1)
    data.setup("fit")
    assert len(data.train_set) == 4 and data.vocab_size == 70_001  # 2 windows per shard, none across shards
    assert data.train_set[2][0].tolist() == big[::-1][:4].tolist()


def write_bad(path, case: str) -> dict:
    """A bad token file (and the datamodule kwargs that read it) for each refusal."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240520, 1, 100
    tokens = np.arange(100, dtype="<u2")
    if case == "magic":
        header[0] = 20240519
        path.write_bytes(header.tobytes() + tokens.tobytes())
        return {"token_format": "llmc"}
    if case == "version":
        header[1] = 3
    if case == "truncated":
        header[2] = 1000
    if case == "odd-bytes":
        path.write_bytes(tokens.tobytes() + b"\0")
        return {}
    if case == "short":
        write_token_file(path, tokens[:10])
        return {}
    path.write_bytes(header.tobytes() + tokens.tobytes())
    return {}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("magic", r"has magic 20240519, not llm.c's 20240520"),
        ("version", r"llm.c version 3; valid versions: 1 \(uint16 tokens\) and 2"),
        ("truncated", r"claims 1000 uint16 tokens in its header but holds 100"),
        ("odd-bytes", r"201 bytes, not a whole number of uint16 tokens"),
        ("short", r"train.bin: 10 tokens cannot fill one window of block_size=16"),
    ],
)
def test_bad_token_files_are_refused(tmp_path, case, message):
    kwargs = write_bad(tmp_path / "train.bin", case)
    write_token_file(tmp_path / "val.bin", np.arange(100))
    data = GPTDataModule(data_dir=str(tmp_path), block_size=16, batch_size=2, **kwargs)
    with pytest.raises(ConfigurationError, match=message):
        data.setup("fit")


def test_missing_data_dir_names_the_prepare_command(tmp_path):
    with pytest.raises(ConfigurationError, match=r"holds no token data .*python -m lightscale.recipes.gpt.prepare"):
        GPTDataModule(data_dir=str(tmp_path / "nope")).setup("fit")


def test_vocabulary_larger_than_the_model_is_refused(corpus, tmp_path):
    text, tokenizer = corpus
    data = GPTDataModule([text], tokenizer=tokenizer, block_size=32, batch_size=4, cache_dir=str(tmp_path))
    module = GPTModule(GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=32))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False)
    with pytest.raises(ConfigurationError, match=r"vocabulary has 320 tokens but the model's vocab_size is 256"):
        trainer.fit(module, data)

"""GPT data: tokenizer, cached memmap, windows, and the StreamSampler sharding guarantees."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightscale.recipes.gpt import ByteTokenizer, GPTDataModule
from lightscale.recipes.gpt.data import StreamSampler, TokenWindows, default_corpus, tokenize_to_memmap


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "héllo, wörld → ok"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(list(ids)) == text


def test_default_corpus_is_stable_text():
    corpus = default_corpus()
    assert len(corpus) > 100_000
    assert corpus == default_corpus()


def test_memmap_cache_is_content_named_and_reused(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("abc" * 10, encoding="utf-8")
    b.write_text("xyz" * 10, encoding="utf-8")
    cache = tmp_path / "cache"
    path = tokenize_to_memmap([str(a)], cache, ByteTokenizer())
    assert path.parent == cache and path.suffix == ".bin"
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    assert tokens.tolist() == list(b"abc" * 10)
    mtime = os.stat(path).st_mtime_ns
    assert tokenize_to_memmap([str(a)], cache, ByteTokenizer()) == path
    assert os.stat(path).st_mtime_ns == mtime  # reused, not rewritten
    other = tokenize_to_memmap([str(b)], cache, ByteTokenizer())
    assert other != path  # different content, different name
    assert sorted(p.name for p in cache.iterdir()) == sorted([path.name, other.name])  # no temp files left


def test_missing_text_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        tokenize_to_memmap([str(tmp_path / "nope.txt")], tmp_path, ByteTokenizer())


def test_token_windows_are_shifted_and_non_overlapping():
    tokens = np.arange(23, dtype=np.uint16)
    ds = TokenWindows(tokens, block_size=5)
    assert len(ds) == 4  # (23 - 1) // 5
    x, y = ds[1]
    assert x.dtype == torch.int64
    assert x.tolist() == [5, 6, 7, 8, 9] and y.tolist() == [6, 7, 8, 9, 10]
    assert ds[3][1].tolist() == [16, 17, 18, 19, 20]


def batches(sampler: StreamSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    flat = list(sampler)
    assert len(flat) == len(sampler)
    return [flat[i : i + sampler.batch_size] for i in range(0, len(flat), sampler.batch_size)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_union_of_ranks_equals_single_process(shuffle):
    n, ranks, b = 53, 3, 4
    single = StreamSampler(range(n), batch_size=ranks * b, shuffle=shuffle, seed=7)
    for epoch in range(3):
        whole = batches(single, epoch)
        per_rank = [
            batches(StreamSampler(range(n), batch_size=b, num_replicas=ranks, rank=r, shuffle=shuffle, seed=7), epoch)
            for r in range(ranks)
        ]
        assert len(whole) == 53 // 12 == 4
        for g, global_batch in enumerate(whole):
            assert [i for r in range(ranks) for i in per_rank[r][g]] == global_batch


@pytest.mark.parametrize("shuffle", [True, False])
def test_no_sample_dropped_or_duplicated_across_ranks_and_epochs(shuffle):
    n, ranks, b = 50, 2, 3  # global batch 6 -> 8 batches/epoch, 2 leftover samples roll into the next epoch
    samplers = [
        StreamSampler(range(n), batch_size=b, num_replicas=ranks, rank=r, shuffle=shuffle) for r in range(ranks)
    ]
    seen: list[int] = []
    for epoch in range(25):  # 25 epochs * 48 samples = 1200 = exactly 24 passes over 50 samples
        for g in range(8):
            for sampler in samplers:
                seen += batches(sampler, epoch)[g]
    assert len(seen) == 1200
    for k in range(24):  # every consecutive block of n stream samples is one full permutation
        assert sorted(seen[k * n : (k + 1) * n]) == list(range(n))
    if not shuffle:
        assert seen[:60] == list(range(50)) + list(range(10))  # epoch 1 starts with the 2 leftovers (48, 49)


def test_shuffle_is_deterministic_and_seeded():
    def order(seed: int, epoch: int) -> list[int]:
        sampler = StreamSampler(range(40), batch_size=4, num_replicas=2, rank=1, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(3, 0) == order(3, 0)
    assert order(3, 0) != order(4, 0)
    assert order(3, 0) != order(3, 1)
    assert order(3, 0) != sorted(order(3, 0))


def test_without_roll_over_every_epoch_reads_the_same_batches():
    sampler = StreamSampler(range(10), batch_size=3, shuffle=False, roll_over=False)
    assert batches(sampler, 0) == batches(sampler, 5) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_dataset_smaller_than_a_global_batch_is_an_error():
    with pytest.raises(ValueError, match="5 samples, fewer than one global batch of 8"):
        StreamSampler(range(5), batch_size=4, num_replicas=2, rank=0)


def test_datamodule_end_to_end(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("".join(chr(97 + i % 26) for i in range(1001)), encoding="utf-8")
    dm = GPTDataModule([str(text)], block_size=10, batch_size=4, val_fraction=0.2, cache_dir=str(tmp_path / "c"))
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == (800 - 1) // 10 and len(dm.val_set) == (201 - 1) // 10
    loader = dm.train_dataloader()
    assert len(loader) == 79 // 4
    x, y = next(iter(loader))
    assert x.shape == y.shape == (4, 10) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    val = [x for x, _ in dm.val_dataloader()]
    assert len(val) == 5 and val[0][0, 0].item() == ord("a") + 800 % 26  # val starts after the train split


def test_datamodule_shards_by_the_strategy_sampler_kwargs(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("0123456789" * 100, encoding="utf-8")
    kwargs = {"block_size": 10, "batch_size": 4, "seed": 5, "cache_dir": str(tmp_path / "c")}

    def first_batch(num_replicas: int, rank: int, batch_size: int) -> list[int]:
        dm = GPTDataModule([str(text)], **{**kwargs, "batch_size": batch_size})
        strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": rank})
        dm.trainer = SimpleNamespace(strategy=strategy)
        dm.setup("fit")
        loader = dm.train_dataloader()
        assert isinstance(loader.sampler, StreamSampler) and loader.sampler.num_replicas == num_replicas
        return list(loader.sampler)[:batch_size]

    assert first_batch(2, 0, 4) + first_batch(2, 1, 4) == first_batch(1, 0, 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size and batch_size must be positive"),
        ({"val_fraction": 1.0}, "val_fraction must be in \\(0, 1\\)"),
        ({"num_workers": -1}, "num_workers must be >= 0"),
    ],
)
def test_datamodule_validates_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTDataModule(**kwargs)


def test_datamodule_rejects_a_bare_path():
    with pytest.raises(TypeError, match="wrap it in"):
        GPTDataModule("corpus.txt")

"""Data plumbing: which shard a rank reads (data_shard), the sampler, loader positions and their checkpoint state,
the check that ranks sharing a batch read the same one, and self-sharding streams (litdata, Hugging Face)."""

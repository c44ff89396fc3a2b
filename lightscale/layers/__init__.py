"""Modules a model uses, single-device: the MoE layer and its grouped GEMM, float8 linear conversion."""

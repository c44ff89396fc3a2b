"""Every line that knows DeepSpeed: the ZeRO config, the engine's setup and introspection, its CPU ops, its own
checkpoint directories and the portable layout's ZeRO side. DeepSpeed itself is imported lazily (the extra)."""

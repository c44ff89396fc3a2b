"""Measurement that takes part in no training step: collectives counted (and slowed) as they run, and the bytes
autograd saves for backward; the callbacks, the estimator and the exact-communication tests read them."""

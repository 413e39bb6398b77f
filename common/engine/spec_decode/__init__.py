"""Speculative decoding: proposers (n-gram, draft model), the verify step's acceptance
(rejection sampling that keeps the target distribution exact) and its counters."""

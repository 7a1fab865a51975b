"""Regeneration of answers by the verifier: the in-process slot engine, endpoints, replicas, resume log."""

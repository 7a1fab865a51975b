"""Verifier hidden-state capture backends (stage 02). See ``eagle3.capture.base`` for the contract."""

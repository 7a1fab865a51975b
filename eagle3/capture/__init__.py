"""Verifier hidden-state capture backends (stage 02). See ``eagle3.capture.base`` for the contract."""

from eagle3.capture.base import NUM_CAPTURED, BackendInfo, CaptureBackend, check_captured

__all__ = ["NUM_CAPTURED", "BackendInfo", "CaptureBackend", "check_captured"]

"""eagle3-train: a staged pipeline that trains EAGLE-3 drafters for large verifier models."""

__version__ = "0.1.0"

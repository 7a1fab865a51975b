"""Chat rendering and loss masks (01, 02, 05)."""

"""Dataset sources: each reads one on-disk format and writes a new store atomically."""

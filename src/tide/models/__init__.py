"""What Tide knows about model families: the per-family table (`architectures`), a tiny config of any type
(`tiny`), and every private transformers piece Tide relies on (`compat`, checked by a test)."""

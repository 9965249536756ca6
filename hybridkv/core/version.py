"""hybridkv's version, on the lowest floor: the package exports it, and the
cache identity (identity.py) digests it, since the model code computes the KV."""

VERSION = "0.1.0"

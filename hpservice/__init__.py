"""hpservice: a distributed training service with its own HSDP engine (see README.md)."""

__version__ = "0.1.0"

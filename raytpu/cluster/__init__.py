"""Reaching a Ray cluster and reading what it offers: the driver side of every command that joins one."""

"""Deployment: the command line (and, next, the YAML schema, the Ray launcher and the tuner)."""

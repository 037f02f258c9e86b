"""Decode worker: holds reservations, receives pushed KV, decodes with continuous batching."""

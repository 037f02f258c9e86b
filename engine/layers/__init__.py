"""Tensor-parallel building blocks of the models."""

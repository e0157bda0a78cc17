"""Benchmarks that reproduce every performance claim in the README."""

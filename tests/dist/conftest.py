"""Fixtures shared by the distributed tests: ``solo`` (a one-rank gloo group
in this process) is in tests/conftest.py, shared with the unit tier."""

"""Test-only helpers shared by the arbiterd test suite."""

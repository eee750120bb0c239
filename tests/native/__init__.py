"""Tests of arbiterd/native: the libllama handle and the in-place residency probe."""

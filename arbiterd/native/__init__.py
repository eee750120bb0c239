"""Raw symbols of the libllama that llama_cpp loaded (the in-place residency API of issue 3).
Nothing else in arbiterd touches ctypes handles of libllama."""

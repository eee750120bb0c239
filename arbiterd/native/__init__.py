"""Raw symbols of the libllama that llama_cpp loaded (the in-place residency API of issue 3).

`libllama` finds that library and probes it, or any other path, for the residency API.
Nothing else in arbiterd opens ctypes handles of libllama itself."""

"""ctypes handles on the engine's own libraries, worker side only.

`libllama` finds the libllama llama_cpp loaded and probes it, or any other path, for the in-place
residency API that llama-residency.patch adds (README.md beside this file); `ggml` lists the
devices of the ggml it links against. Nothing else in arbiterd opens ctypes handles of them."""

"""ctypes handles on the engine's own libraries, for the engine processes only.

    libllama  finds the libllama llama_cpp loaded and probes it, or any other path, for the
              in-place residency API that llama-residency.patch adds (README.md beside this file)
    ggml      the devices of the ggml it links against, and how fast ggml moves bytes to them
    rpc       llama.cpp's RPC backend: servers asked over their protocol, registered, served

Nothing else in arbiterd opens ctypes handles of them."""

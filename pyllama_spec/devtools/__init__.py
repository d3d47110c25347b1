"""What tests, benchmarks and the demo use beside the library: tiny GGUF model writers, the
widened trained pair, the llama-server benchmark harness, a local ggml RPC server."""

"""GGUF files in pure Python: reading and validating them before llama.cpp does (``check``),
writing them (``writer``, for the tiny models), and estimating what a configuration of them
needs in memory (``memory``)."""

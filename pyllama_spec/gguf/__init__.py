"""GGUF files in pure Python: reading them (``reader``: the one reader of the package) and
validating them before llama.cpp does (``check``), writing them (``writer``, for the tiny
models), and estimating what a configuration of them needs in memory (``memory``)."""

"""llama-cpp-python's prompt caches: ``Llama.set_cache(LlamaRAMCache())`` keeps each completion's state
(``Llama.save_state``) under its tokens, and a later completion whose prompt shares a longer prefix with
one of them than the context holds starts from that state.

``LlamaDiskCache`` keeps them in a folder through ``diskcache`` (as llama-cpp-python does; the
``llama-cpp`` extra installs it). Its states are this package's ``LlamaState``s: a folder written by the
real llama-cpp-python is not read here, nor the other way round.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

LlamaState = Any  # pyllama_spec.llama_cpp.llama.LlamaState (which imports this module)


def longest_token_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from their start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class BaseLlamaCache(ABC):
    """A cache of ``LlamaState``s keyed by token tuples; a lookup finds the key sharing the longest
    prefix, and a store beyond ``capacity_bytes`` drops the oldest entries. A kind of cache says where
    the states live (``_keys``, ``_take``, ``_put``, ``_drop_oldest``, ``__len__``, ``cache_size``)."""

    def __init__(self, capacity_bytes: int = (2 << 30)) -> None:
        self.capacity_bytes = capacity_bytes

    @property
    @abstractmethod
    def cache_size(self) -> int: ...

    @abstractmethod
    def _keys(self): ...

    @abstractmethod
    def _take(self, key: tuple[int, ...]) -> LlamaState: ...

    @abstractmethod
    def _put(self, key: tuple[int, ...], value: LlamaState) -> None: ...

    @abstractmethod
    def _drop_oldest(self) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def _find_longest_prefix_key(self, key: tuple[int, ...]) -> tuple[int, ...] | None:
        best, best_key = 0, None
        for k in self._keys():
            n = longest_token_prefix(k, key)
            if n > best:
                best, best_key = n, k
        return best_key

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        found = self._find_longest_prefix_key(tuple(key))
        if found is None:
            raise KeyError("Key not found")
        return self._take(found)

    def __contains__(self, key: Sequence[int]) -> bool:
        return self._find_longest_prefix_key(tuple(key)) is not None

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        self._put(tuple(int(t) for t in key), value)
        while self.cache_size > self.capacity_bytes and len(self):
            self._drop_oldest()


class LlamaRAMCache(BaseLlamaCache):
    """States in memory, the least recently used dropped first beyond ``capacity_bytes`` (counted as
    their memory images, as llama-cpp-python counts them)."""

    def __init__(self, capacity_bytes: int = (2 << 30)) -> None:
        super().__init__(capacity_bytes)
        self.cache_state: OrderedDict[tuple[int, ...], LlamaState] = OrderedDict()

    @property
    def cache_size(self) -> int:
        return sum(state.llama_state_size for state in self.cache_state.values())

    def _keys(self):
        return self.cache_state.keys()

    def _take(self, key: tuple[int, ...]) -> LlamaState:
        self.cache_state.move_to_end(key)
        return self.cache_state[key]

    def _put(self, key: tuple[int, ...], value: LlamaState) -> None:
        self.cache_state.pop(key, None)
        self.cache_state[key] = value

    def _drop_oldest(self) -> None:
        self.cache_state.popitem(last=False)

    def __len__(self) -> int:
        return len(self.cache_state)


LlamaCache = LlamaRAMCache  # llama-cpp-python's older name


class LlamaDiskCache(BaseLlamaCache):
    """States in the folder ``cache_dir`` (through ``diskcache``), the oldest dropped first beyond
    ``capacity_bytes``. A state read back is taken out of the folder, as llama-cpp-python does."""

    def __init__(self, cache_dir: str = ".cache/llama_cache", capacity_bytes: int = (2 << 30)) -> None:
        super().__init__(capacity_bytes)
        try:
            import diskcache
        except ImportError:
            raise ImportError("LlamaDiskCache keeps its states with the diskcache package: "
                              "pip install 'pyllama-spec[llama-cpp]' (or pip install diskcache)") from None
        self.cache = diskcache.Cache(cache_dir)

    @property
    def cache_size(self) -> int:
        return int(self.cache.volume())

    def _keys(self):
        return self.cache.iterkeys()

    def _take(self, key: tuple[int, ...]) -> LlamaState:
        return self.cache.pop(key)

    def _put(self, key: tuple[int, ...], value: LlamaState) -> None:
        self.cache.pop(key, None)
        self.cache[key] = value

    def _drop_oldest(self) -> None:
        del self.cache[next(iter(self.cache))]

    def __len__(self) -> int:
        return len(self.cache)

"""A llama.cpp sampler chain over a Model's vocabulary."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyllama_spec._native import lib
from pyllama_spec.bindings.handle import NativeHandle

if TYPE_CHECKING:
    from pyllama_spec.bindings.context import Context
    from pyllama_spec.bindings.model import Model


class Sampler(NativeHandle):
    """A llama.cpp sampler chain: penalties -> top-k -> top-p -> min-p -> temperature -> dist, or greedy."""

    _what = "sampler"

    def __init__(self, model: Model, *, temperature: float = 0.0, top_k: int = 40, top_p: float = 0.95,
                 min_p: float = 0.05, presence_penalty: float = 0.0, repeat_penalty: float = 1.0,
                 frequency_penalty: float = 0.0, penalty_last_n: int = 64, seed: int = 0) -> None:
        self.temperature = temperature
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        self._ptr = chain
        if presence_penalty or frequency_penalty or repeat_penalty != 1.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_penalties(
                model.n_vocab, penalty_last_n, repeat_penalty, frequency_penalty, presence_penalty))
        if temperature <= 0.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            return
        if top_k > 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(top_k))
        if top_p < 1.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(top_p, 1))
        if min_p > 0.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(min_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(temperature))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))

    def _free(self, ptr) -> None:
        lib.llama_sampler_free(ptr)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def sample(self, ctx: Context, i: int = -1) -> int:
        """Sample from output row i of ctx's last decode (and accept the token)."""
        return int(lib.llama_sampler_sample(self.ptr, ctx.ptr, i))

    def accept(self, token: int) -> None:
        lib.llama_sampler_accept(self.ptr, token)

    def reset(self) -> None:
        lib.llama_sampler_reset(self.ptr)

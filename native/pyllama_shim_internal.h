// What the shim's C++ files share (never seen by cffi).
#pragma once

#include <cstddef>
#include <cstdint>

struct llama_sampler;

namespace pyllama {
// Keep `what` as this thread's pyllama_last_error() and return -1.
int32_t fail(const char * what);
// The stacks llama.cpp's grammar engine follows now in `smpl` (a grammar sampler, the chat
// constraint, or a chain of samplers: the most in any grammar in it); 0 without a grammar.
// *n_vocab becomes at least the vocabulary size of the grammars in it.
size_t grammar_stacks(const llama_sampler * smpl, size_t * n_vocab);
}  // namespace pyllama

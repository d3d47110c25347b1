// Thin extern "C" forwarding, plus the one piece of logic that must be native: noticing
// Ctrl-C while a long native call runs (Python's own handler only runs between bytecodes).
#include "pyllama_shim.h"

#include "llama-ext.h"
#include "mtmd.h"

#include <csignal>

namespace {

volatile std::sig_atomic_t g_interrupted = 0;
int32_t g_abort_countdown = 0;  // > 0: abort at that many-th check (fault injection in tests)

#ifndef _WIN32
struct sigaction g_previous;

// Note the interrupt, then hand it to the handler that was there before (Python's), which
// raises KeyboardInterrupt once the native call returns.
void on_sigint(int sig, siginfo_t * info, void * uctx) {
    g_interrupted = 1;
    if (g_previous.sa_flags & SA_SIGINFO) {
        if (g_previous.sa_sigaction) {
            g_previous.sa_sigaction(sig, info, uctx);
        }
    } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN && g_previous.sa_handler) {
        g_previous.sa_handler(sig);
    }
}

bool hook_is_installed() {
    struct sigaction current;
    if (sigaction(SIGINT, nullptr, &current) != 0) {
        return false;
    }
    return (current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigint;
}
#endif

}  // namespace

extern "C" {

void pyllama_set_embeddings_layer_inp(llama_context * ctx, uint32_t lid, bool value) {
    llama_set_embeddings_layer_inp(ctx, lid, value);
}

float * pyllama_get_embeddings_layer_inp(llama_context * ctx, uint32_t lid) {
    return llama_get_embeddings_layer_inp(ctx, lid);
}

void pyllama_set_embeddings_nextn(llama_context * ctx, bool value, bool masked) {
    llama_set_embeddings_nextn(ctx, value, masked);
}

float * pyllama_get_embeddings_nextn(llama_context * ctx) {
    return llama_get_embeddings_nextn(ctx);
}

float * pyllama_get_embeddings_nextn_ith(llama_context * ctx, int32_t i) {
    return llama_get_embeddings_nextn_ith(ctx, i);
}

llama_context * pyllama_get_ctx_other(llama_context * ctx) {
    return llama_get_ctx_other(ctx);
}

const int32_t * pyllama_model_target_layer_ids(const llama_model * model) {
    return llama_model_target_layer_ids(model);
}

uint32_t pyllama_model_target_layer_ids_n(const llama_model * model) {
    return llama_model_target_layer_ids_n(model);
}

int32_t pyllama_model_dflash_selector_top_k(const llama_model * model) {
    return llama_model_dflash_selector_top_k(model);
}

int32_t pyllama_model_n_devices(const llama_model * model) {
    return llama_model_n_devices(model);
}

int32_t pyllama_batch_ext_add_tokens(llama_batch_ext * batch, int32_t seq_id, int32_t n,
                                     const int32_t * tokens, const int32_t * pos, const int8_t * outputs) {
    for (int32_t i = 0; i < n; ++i) {
        const int32_t idx = llama_batch_ext_add_token(batch, seq_id, tokens[i]);
        if (idx < 0) {
            return idx;
        }
        if (!llama_batch_ext_set_pos(batch, idx, pos + i)) {
            return -4;
        }
        if (outputs && outputs[i]) {
            llama_batch_ext_set_output_logits(batch, idx, true);
        }
    }
    return n;
}

int32_t pyllama_batch_ext_add_embds(llama_batch_ext * batch, int32_t seq_id, int32_t n,
                                    const float * embd, size_t n_embd,
                                    const int32_t * pos, size_t n_pos, const int8_t * outputs) {
    for (int32_t i = 0; i < n; ++i) {
        llama_embd row = { embd + (size_t) i * n_embd, 1, n_embd };
        const int32_t idx = llama_batch_ext_add_embd(batch, seq_id, row);
        if (idx < 0) {
            return idx;
        }
        if (!llama_batch_ext_set_pos(batch, idx, pos + (size_t) i * n_pos)) {
            return -4;
        }
        if (outputs && outputs[i]) {
            llama_batch_ext_set_output_logits(batch, idx, true);
        }
    }
    return n;
}

int32_t pyllama_interrupt_hook(bool install) {
#ifdef _WIN32
    (void) install;
    return 0;
#else
    const bool installed = hook_is_installed();
    if (install && !installed) {
        struct sigaction ours;
        if (sigaction(SIGINT, nullptr, &g_previous) != 0) {
            return 0;
        }
        ours = g_previous;
        ours.sa_flags |= SA_SIGINFO;
        ours.sa_sigaction = on_sigint;
        return sigaction(SIGINT, &ours, nullptr) == 0 ? 1 : 0;
    }
    if (!install && installed) {
        sigaction(SIGINT, &g_previous, nullptr);
        return 0;
    }
    return installed ? 1 : 0;
#endif
}

bool pyllama_abort_requested(void * data) {
    (void) data;
    if (g_abort_countdown > 0 && --g_abort_countdown == 0) {
        return true;
    }
    return g_interrupted != 0;
}

void pyllama_abort_after(int32_t n_checks) {
    g_abort_countdown = n_checks > 0 ? n_checks : 0;
}

int32_t pyllama_mtmd_set_abort_callback(mtmd_context * ctx) {
#ifdef MTMD_HAS_ABORT_CALLBACK  // patches/0002; a user's unpatched checkout lacks it
    mtmd_set_abort_callback(ctx, pyllama_abort_requested, nullptr);
    return 1;
#else
    (void) ctx;
    return 0;
#endif
}

int32_t pyllama_interrupt_take(void) {
    const int32_t was = g_interrupted ? 1 : 0;
    g_interrupted = 0;
    return was;
}

int32_t pyllama_shim_abi_version(void) {
    return 2;
}

}

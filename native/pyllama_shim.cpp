// Thin extern "C" forwarding; no logic lives here.
#include "pyllama_shim.h"

#include "llama-ext.h"

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

int32_t pyllama_shim_abi_version(void) {
    return 1;
}

}

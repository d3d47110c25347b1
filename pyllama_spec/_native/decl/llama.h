/* cffi declarations: the parts of llama.h the package uses. */
typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;
typedef struct llama_memory_i * llama_memory_t;

struct llama_model;
struct llama_context;
struct llama_vocab;
struct llama_sampler;
struct llama_batch_ext;

enum llama_rope_type {
    LLAMA_ROPE_TYPE_NONE, LLAMA_ROPE_TYPE_NORM, LLAMA_ROPE_TYPE_NEOX,
    LLAMA_ROPE_TYPE_MROPE, LLAMA_ROPE_TYPE_IMROPE, LLAMA_ROPE_TYPE_VISION, ...
};
enum llama_flash_attn_type {
    LLAMA_FLASH_ATTN_TYPE_AUTO, LLAMA_FLASH_ATTN_TYPE_DISABLED, LLAMA_FLASH_ATTN_TYPE_ENABLED, ...
};
enum llama_process_type { LLAMA_PROCESS_TYPE_ENCODE, LLAMA_PROCESS_TYPE_DECODE, ... };
enum llama_context_type { LLAMA_CONTEXT_TYPE_DEFAULT, LLAMA_CONTEXT_TYPE_MTP, ... };
enum llama_pooling_type {
    LLAMA_POOLING_TYPE_UNSPECIFIED, LLAMA_POOLING_TYPE_NONE, LLAMA_POOLING_TYPE_MEAN, LLAMA_POOLING_TYPE_CLS,
    LLAMA_POOLING_TYPE_LAST, LLAMA_POOLING_TYPE_RANK, ...
};

typedef struct llama_token_data {
    llama_token id;
    float logit;
    float p;
} llama_token_data;

typedef struct llama_token_data_array {
    llama_token_data * data;
    size_t size;
    int64_t selected;
    bool sorted;
} llama_token_data_array;

typedef struct llama_batch {
    int32_t n_tokens;
    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

struct llama_embd {
    const float * data;
    size_t n_rows;
    size_t n_embd;
};

enum llama_load_mode {
    LLAMA_LOAD_MODE_AUTO, LLAMA_LOAD_MODE_NONE, LLAMA_LOAD_MODE_MMAP, LLAMA_LOAD_MODE_MLOCK,
    LLAMA_LOAD_MODE_MMAP_MLOCK, ...
};

enum llama_split_mode {
    LLAMA_SPLIT_MODE_NONE, LLAMA_SPLIT_MODE_LAYER, LLAMA_SPLIT_MODE_ROW, LLAMA_SPLIT_MODE_TENSOR, ...
};

struct llama_model_tensor_buft_override {
    const char * pattern;
    ggml_backend_buffer_type_t buft;
};

struct llama_model_params {
    ggml_backend_dev_t * devices;
    const struct llama_model_tensor_buft_override * tensor_buft_overrides;
    int32_t n_gpu_layers;
    enum llama_split_mode split_mode;
    enum llama_load_mode load_mode;
    int32_t main_gpu;
    const float * tensor_split;
    bool vocab_only;
    bool check_tensors;
    bool load_mtp;
    ...;
};

struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    uint32_t n_rs_seq;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    enum llama_flash_attn_type flash_attn_type;
    enum ggml_type type_k;
    enum ggml_type type_v;
    enum llama_pooling_type pooling_type;
    bool embeddings;
    bool offload_kqv;
    bool no_perf;
    bool swa_full;
    bool kv_unified;
    struct llama_context * ctx_other;
    enum llama_context_type ctx_type;
    ...;
};

typedef struct llama_logit_bias {
    llama_token token;
    float bias;
} llama_logit_bias;

typedef struct llama_sampler_chain_params {
    bool no_perf;
} llama_sampler_chain_params;

typedef struct llama_chat_message {
    const char * role;
    const char * content;
} llama_chat_message;

/* lifecycle */
const char * llama_version(void);
void llama_backend_init(void);
void llama_backend_free(void);
const char * llama_print_system_info(void);
bool llama_supports_gpu_offload(void);
bool llama_supports_mlock(void);
bool llama_supports_rpc(void);
size_t llama_max_devices(void);
void llama_log_set(ggml_log_callback log_callback, void * user_data);

struct llama_model_params   llama_model_default_params(void);
struct llama_context_params llama_context_default_params(void);
struct llama_sampler_chain_params llama_sampler_chain_default_params(void);

struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);

/* model facts */
const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
enum llama_rope_type llama_model_rope_type(const struct llama_model * model);
int32_t llama_model_n_ctx_train(const struct llama_model * model);
int32_t llama_model_n_embd(const struct llama_model * model);
int32_t llama_model_n_embd_inp(const struct llama_model * model);
int32_t llama_model_n_layer(const struct llama_model * model);
int32_t llama_model_n_layer_nextn(const struct llama_model * model);
int32_t llama_model_n_head(const struct llama_model * model);
int32_t llama_model_n_head_kv(const struct llama_model * model);
int32_t llama_model_n_swa(const struct llama_model * model);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
int32_t llama_model_meta_count(const struct llama_model * model);
int32_t llama_model_meta_key_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
int32_t llama_model_meta_val_str_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
uint64_t llama_model_size(const struct llama_model * model);
uint64_t llama_model_n_params(const struct llama_model * model);
const char * llama_model_chat_template(const struct llama_model * model, const char * name);
bool llama_model_is_recurrent(const struct llama_model * model);
bool llama_model_is_hybrid(const struct llama_model * model);
bool llama_model_has_encoder(const struct llama_model * model);
int32_t llama_model_n_embd_out(const struct llama_model * model);
uint32_t llama_model_n_cls_out(const struct llama_model * model);

/* context facts */
uint32_t llama_n_ctx(const struct llama_context * ctx);
uint32_t llama_n_ctx_seq(const struct llama_context * ctx);
uint32_t llama_n_batch(const struct llama_context * ctx);
uint32_t llama_n_ubatch(const struct llama_context * ctx);
uint32_t llama_n_seq_max(const struct llama_context * ctx);
uint32_t llama_n_rs_seq(const struct llama_context * ctx);
const struct llama_model * llama_get_model(const struct llama_context * ctx);
llama_memory_t llama_get_memory(const struct llama_context * ctx);
void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
void llama_set_abort_callback(struct llama_context * ctx, ggml_abort_callback abort_callback, void * abort_callback_data);
void llama_set_embeddings(struct llama_context * ctx, bool embeddings);
enum llama_pooling_type llama_pooling_type(const struct llama_context * ctx);
void llama_set_causal_attn(struct llama_context * ctx, bool causal_attn);
bool llama_get_causal_attn(const struct llama_context * ctx);
void llama_synchronize(struct llama_context * ctx);

/* vocabulary */
int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
const char * llama_vocab_get_text(const struct llama_vocab * vocab, llama_token token);
bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
bool llama_vocab_is_control(const struct llama_vocab * vocab, llama_token token);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);
llama_token llama_vocab_eot(const struct llama_vocab * vocab);
llama_token llama_vocab_nl(const struct llama_vocab * vocab);
llama_token llama_vocab_pad(const struct llama_vocab * vocab);
llama_token llama_vocab_sep(const struct llama_vocab * vocab);
llama_token llama_vocab_mask(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_pre(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_suf(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_mid(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_pad(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_rep(const struct llama_vocab * vocab);
llama_token llama_vocab_fim_sep(const struct llama_vocab * vocab);
bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);
bool llama_vocab_get_add_eos(const struct llama_vocab * vocab);
bool llama_vocab_get_add_sep(const struct llama_vocab * vocab);
int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf,
                             int32_t length, int32_t lstrip, bool special);
int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                         char * text, int32_t text_len_max, bool remove_special, bool unparse_special);
int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
                                  bool add_ass, char * buf, int32_t length);

/* batches and processing */
struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void llama_batch_free(struct llama_batch batch);
int32_t llama_encode(struct llama_context * ctx, struct llama_batch batch);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
struct llama_batch_ext * llama_batch_ext_init(struct llama_context * ctx);
void llama_batch_ext_free(struct llama_batch_ext * batch);
void llama_batch_ext_clear(struct llama_batch_ext * batch);
int32_t llama_batch_ext_add_token(struct llama_batch_ext * batch, llama_seq_id seq_id, llama_token id);
int32_t llama_batch_ext_add_embd(struct llama_batch_ext * batch, llama_seq_id seq_id, struct llama_embd embd);
bool llama_batch_ext_add_seq(struct llama_batch_ext * batch, int32_t idx, llama_seq_id seq_id);
bool llama_batch_ext_set_pos(struct llama_batch_ext * batch, int32_t idx, const llama_pos * pos);
bool llama_batch_ext_set_output_logits(struct llama_batch_ext * batch, int32_t idx, bool value);
bool llama_batch_ext_set_embd_token(struct llama_batch_ext * batch, int32_t idx, struct llama_embd embd);
bool llama_batch_ext_set_embd_state(struct llama_batch_ext * batch, int32_t idx, struct llama_embd embd);
int32_t llama_process(struct llama_context * ctx, enum llama_process_type type, struct llama_batch_ext * batch);

/* outputs */
float * llama_get_logits(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
float * llama_get_embeddings(struct llama_context * ctx);
float * llama_get_embeddings_ith(struct llama_context * ctx, int32_t i);
float * llama_get_embeddings_seq(struct llama_context * ctx, llama_seq_id seq_id);

/* memory (KV cache / recurrent state) */
void llama_memory_clear(llama_memory_t mem, bool data);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
void llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);

/* sampling */
struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
int32_t llama_sampler_chain_n(const struct llama_sampler * chain);
struct llama_sampler * llama_sampler_init_greedy(void);
struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
struct llama_sampler * llama_sampler_init_top_k(int32_t k);
struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp(float t);
struct llama_sampler * llama_sampler_init_penalties(int32_t n_vocab, int32_t penalty_last_n, float penalty_repeat,
                                                    float penalty_freq, float penalty_present);
struct llama_sampler * llama_sampler_init_typical(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp_ext(float t, float delta, float exponent);
struct llama_sampler * llama_sampler_init_xtc(float p, float t, size_t min_keep, uint32_t seed);
struct llama_sampler * llama_sampler_init_top_n_sigma(float n);
struct llama_sampler * llama_sampler_init_mirostat(int32_t n_vocab, uint32_t seed, float tau, float eta, int32_t m);
struct llama_sampler * llama_sampler_init_mirostat_v2(uint32_t seed, float tau, float eta);
struct llama_sampler * llama_sampler_init_grammar(const struct llama_vocab * vocab, const char * grammar_str,
                                                  const char * grammar_root);
struct llama_sampler * llama_sampler_init_dry(const struct llama_vocab * vocab, float dry_multiplier, float dry_base,
                                              int32_t dry_allowed_length, int32_t dry_penalty_last_n,
                                              const char ** seq_breakers, size_t num_breakers);
struct llama_sampler * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n_logit_bias,
                                                     const llama_logit_bias * logit_bias);
const char * llama_sampler_name(const struct llama_sampler * smpl);
void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
void llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p);
void llama_sampler_reset(struct llama_sampler * smpl);
struct llama_sampler * llama_sampler_clone(const struct llama_sampler * smpl);
void llama_sampler_free(struct llama_sampler * smpl);
llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);

/* one sequence's state (its KV cells, recurrent state): slot save and restore */
size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);

/* LoRA adapters (llama-server's --lora, --lora-scaled, /lora-adapters) */
struct llama_adapter_lora;
struct llama_adapter_lora * llama_adapter_lora_init(struct llama_model * model, const char * path_lora);
int32_t llama_adapter_meta_val_str(const struct llama_adapter_lora * adapter, const char * key, char * buf,
                                   size_t buf_size);
void llama_adapter_lora_free(struct llama_adapter_lora * adapter);
int32_t llama_set_adapters_lora(struct llama_context * ctx, struct llama_adapter_lora ** adapters, size_t n_adapters,
                                float * scales);

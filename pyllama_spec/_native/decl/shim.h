/* cffi declarations: native/pyllama_shim.h (C linkage over src/llama-ext.h). */
struct pyllama_chat_templates;
struct pyllama_chat_parser;
void     pyllama_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid, bool value);
float *  pyllama_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid);
void     pyllama_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
float *  pyllama_get_embeddings_nextn(struct llama_context * ctx);
const int32_t * pyllama_model_target_layer_ids(const struct llama_model * model);
uint32_t pyllama_model_target_layer_ids_n(const struct llama_model * model);
int32_t  pyllama_model_dflash_selector_top_k(const struct llama_model * model);
int32_t  pyllama_batch_ext_add_tokens(struct llama_batch_ext * batch, int32_t seq_id, int32_t n,
                                      const int32_t * tokens, const int32_t * pos, const int8_t * outputs);
int32_t  pyllama_batch_ext_add_embds(struct llama_batch_ext * batch, int32_t seq_id, int32_t n,
                                     const float * embd, size_t n_embd,
                                     const int32_t * pos, size_t n_pos, const int8_t * outputs);
int32_t  pyllama_draft_chain(struct llama_context * ctx, struct llama_batch_ext * batch, int32_t n_seq,
                             const int32_t * seq_ids, const int32_t * next_pos, const int32_t * n_max,
                             int32_t max_n, float p_min, int32_t top_k, bool feed_states, int32_t n_vocab,
                             int32_t n_embd, int32_t * tokens, float * logits, int32_t * n_drafted,
                             int32_t * n_last_rows);
int32_t  pyllama_interrupt_hook(bool install);
bool     pyllama_abort_requested(void * data);
int32_t  pyllama_interrupt_take(void);
int32_t  pyllama_mtmd_set_abort_callback(struct mtmd_context * ctx);
void     pyllama_abort_after(int32_t n_checks);
int32_t  pyllama_grammar_check(const char * gbnf, double * cost);
void     pyllama_grammar_limit(size_t max_stacks, double max_stacks_times_vocab);
int32_t  pyllama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
int32_t  pyllama_sampler_accept(struct llama_sampler * smpl, int32_t token);
int64_t  pyllama_json_schema_to_grammar(const char * schema_json, char * out, size_t n_out);
const char * pyllama_last_error(void);
void     pyllama_string_free(char * s);
struct pyllama_chat_templates * pyllama_chat_templates_init(const struct llama_model * model, const char * override_src);
void     pyllama_chat_templates_free(struct pyllama_chat_templates * t);
char *   pyllama_chat_templates_info(const struct pyllama_chat_templates * t, bool use_jinja, const char * kwargs_json);
char *   pyllama_chat_templates_apply(const struct pyllama_chat_templates * t, const char * inputs_json);
struct pyllama_chat_parser * pyllama_chat_parser_init(const char * params_json);
void     pyllama_chat_parser_free(struct pyllama_chat_parser * p);
char *   pyllama_chat_parser_update(struct pyllama_chat_parser * p, const char * text_added, size_t n, bool is_partial);
struct llama_sampler * pyllama_sampler_init_chat_constraint(const struct llama_vocab * vocab, const char * spec_json);
int32_t  pyllama_shim_abi_version(void);

/* Python callbacks (cffi "extern Python"): native logs and mtmd's post-decode hook. */
extern "Python" void pyllama_log_callback(enum ggml_log_level level, const char * text, void * user_data);
extern "Python" int32_t pyllama_post_decode_callback(const struct mtmd_helper_embd_batch * batch, void * user_data);

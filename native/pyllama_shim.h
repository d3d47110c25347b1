/* C-linkage wrappers over the functions of llama.cpp's src/llama-ext.h that
 * speculative decoding needs (llama-ext.h declares them without extern "C", so
 * their symbols are C++-mangled and cffi cannot bind them directly), and over the
 * C++ of llama.cpp that throws: the grammar and its sampler, common's JSON-schema
 * converter. An exception must never cross into C (it would abort the process). */
#ifndef PYLLAMA_SHIM_H
#define PYLLAMA_SHIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct llama_context;
struct llama_model;
struct llama_batch_ext;
struct mtmd_context;

/* Layer-input features of the target: what a DFlash draft is conditioned on. */
void          pyllama_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid, bool value);
float *       pyllama_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid);

/* NextN embeddings of the draft (DFlash2 reads its selector lattice from them). */
void          pyllama_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
float *       pyllama_get_embeddings_nextn(struct llama_context * ctx);

/* What a DFlash draft records about its target. */
const int32_t * pyllama_model_target_layer_ids  (const struct llama_model * model);
uint32_t        pyllama_model_target_layer_ids_n(const struct llama_model * model);
int32_t         pyllama_model_dflash_selector_top_k(const struct llama_model * model);

/* Bulk fill of a llama_batch_ext, so that Python never loops over rows.
 * Token rows: tokens[n], pos[n] (one position each), outputs[n] (0/1, may be NULL).
 * Embedding rows: embd[n * n_embd], pos[n * n_pos] row-major (n_pos positions per
 * row, as the context expects), outputs[n] (may be NULL).
 * Return the number of rows added, or a negative llama_batch_ext error code:
 * -1 batch full, -2 invalid token/embedding, -3 invalid sequence, -4 invalid position. */
int32_t pyllama_batch_ext_add_tokens(struct llama_batch_ext * batch, int32_t seq_id, int32_t n,
                                     const int32_t * tokens, const int32_t * pos, const int8_t * outputs);
int32_t pyllama_batch_ext_add_embds (struct llama_batch_ext * batch, int32_t seq_id, int32_t n,
                                     const float * embd, size_t n_embd,
                                     const int32_t * pos, size_t n_pos, const int8_t * outputs);

/* A drafter's chain of one-token decodes (EAGLE3, MTP, a draft model), without a return to
 * Python between them: each step decodes one row for every sequence still drafting, takes its
 * most likely token and feeds it back at the sequence's next position (next_pos[i] + step), with
 * the row's output ("nextn") embedding as its state where feed_states. The batch holds the first
 * decode's rows, one output row per sequence in the order of seq_ids. A token whose probability
 * among the top_k most likely (top_k <= 0: all) is below p_min (0: never) ends that sequence's
 * draft before it; n_max[i] (<= max_n) tokens end it after. NaN logits are never chosen. The
 * states need the context's nextn embeddings kept for output rows only (masked). Writes
 * tokens[i * max_n + k], their logits rows logits[(i * max_n + k) * n_vocab ...] (NULL: not kept),
 * n_drafted[i], and the rows of the last decode; the batch is cleared on every return. Returns 0;
 * a failing llama_process's code (the outputs hold what came before); -100 when a decode gave no
 * logits or states; -200 + a llama_batch_ext error (-201..-203) when a row was refused, -204 when
 * its position, output flag or state was. */
int32_t pyllama_draft_chain(struct llama_context * ctx, struct llama_batch_ext * batch, int32_t n_seq,
                            const int32_t * seq_ids, const int32_t * next_pos, const int32_t * n_max,
                            int32_t max_n, float p_min, int32_t top_k, bool feed_states, int32_t n_vocab,
                            int32_t n_embd, int32_t * tokens, float * logits, int32_t * n_drafted,
                            int32_t * n_last_rows);

/* Ctrl-C during native calls. pyllama_interrupt_hook(true) chains a SIGINT handler in
 * front of the current one (Python's) that sets a flag; false removes it. Returns 1 when
 * the hook is in place. pyllama_abort_requested is a ggml abort callback reading that
 * flag (a decode stops between graph nodes); pyllama_interrupt_take reads and clears it. */
int32_t pyllama_interrupt_hook(bool install);
bool    pyllama_abort_requested(void * data);
int32_t pyllama_interrupt_take(void);
/* Let Ctrl-C stop a media encode too (the same flag); 0 when this llama.cpp tree cannot. */
int32_t pyllama_mtmd_set_abort_callback(struct mtmd_context * ctx);
/* Tests: make a decode abort at the n-th abort check from now (0 disables), as a native
 * failure in the middle of a batch would: the ubatches already processed stay in memory. */
void    pyllama_abort_after(int32_t n_checks);

/* Constrained output. Each returns -1 when llama.cpp threw (or refused) and leaves the reason
 * in pyllama_last_error() (this thread's; valid until its next failing call).
 * pyllama_grammar_check: 0 when the GBNF parses with a root rule; cost (3 doubles, or NULL) gets
 * the most stacks one advance of llama.cpp's grammar engine makes, the most one accepted character
 * makes, and the stacks of the first advance from the root (paths counted on the parsed rules, an
 * upper bound, capped at 1e30; -1 for left recursion).
 * pyllama_sampler_sample / _accept: llama_sampler_sample / _accept, which throw when a grammar
 * cannot accept the token (its stack is empty); sample returns the token. Both fail when a
 * grammar follows more stacks (or stacks times its vocabulary) than pyllama_grammar_limit allows
 * (unlimited until set).
 * pyllama_json_schema_to_grammar: llama-server's converter (common/json-schema-to-grammar);
 * writes the GBNF into out (n_out bytes with its NUL) and returns its length, which may be
 * >= n_out (then call again with a larger buffer). */
struct llama_sampler;
int32_t      pyllama_grammar_check(const char * gbnf, double * cost);
void         pyllama_grammar_limit(size_t max_stacks, double max_stacks_times_vocab);
int32_t      pyllama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
int32_t      pyllama_sampler_accept(struct llama_sampler * smpl, int32_t token);
int64_t      pyllama_json_schema_to_grammar(const char * schema_json, char * out, size_t n_out);
const char * pyllama_last_error(void);

/* Chat (native/pyllama_chat.cpp): llama.cpp's common chat layer, JSON in and out, as llama-server
 * uses it. The char * results are malloc'd JSON for pyllama_string_free; NULL when llama.cpp threw
 * (the reason in pyllama_last_error()).
 * pyllama_chat_templates_init: common_chat_templates_init (override: template text, or NULL/"" for
 * the model's own). _info: {"caps", "source", "tool_use_source", "example", "supports_thinking"}.
 * _apply: common_chat_templates_apply of {"messages", "tools", "tool_choice", "json_schema",
 * "grammar", "use_jinja", "parallel_tool_calls", "add_generation_prompt", "continue_final_message",
 * "reasoning_format", "enable_thinking", "force_pure_content", "chat_template_kwargs"} giving
 * common_chat_params as {"prompt", "format", "format_name", "grammar", "grammar_lazy",
 * "generation_prompt", "supports_thinking", "thinking_start_tag", "thinking_end_tags",
 * "grammar_triggers", "preserved_tokens", "additional_stops", "parser"}.
 * pyllama_chat_parser_*: one generation's parse state (llama-server's task_result_state); _update
 * adds text and gives {"message", "diffs"} (OpenAI's message and deltas).
 * pyllama_sampler_init_chat_constraint: the grammar (lazy, with triggers) and reasoning budget of
 * common_sampler as one llama_sampler; NULL with an empty reason when there is nothing to constrain. */
struct pyllama_chat_templates;
struct pyllama_chat_parser;
struct llama_vocab;
void                           pyllama_string_free(char * s);
struct pyllama_chat_templates * pyllama_chat_templates_init(const struct llama_model * model, const char * override_src);
void                           pyllama_chat_templates_free(struct pyllama_chat_templates * t);
char *                         pyllama_chat_templates_info(const struct pyllama_chat_templates * t, bool use_jinja,
                                                           const char * kwargs_json);
char *                         pyllama_chat_templates_apply(const struct pyllama_chat_templates * t, const char * inputs_json);
struct pyllama_chat_parser *   pyllama_chat_parser_init(const char * params_json);
void                           pyllama_chat_parser_free(struct pyllama_chat_parser * p);
char *                         pyllama_chat_parser_update(struct pyllama_chat_parser * p, const char * text_added, size_t n,
                                                          bool is_partial);
struct llama_sampler *         pyllama_sampler_init_chat_constraint(const struct llama_vocab * vocab, const char * spec_json);

/* Version of this shim's C API, checked by the Python side at import. */
int32_t         pyllama_shim_abi_version(void);

#ifdef __cplusplus
}
#endif

#endif

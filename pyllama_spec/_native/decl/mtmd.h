/* cffi declarations: the parts of mtmd.h and mtmd-helper.h we use. */
enum mtmd_input_chunk_type {
    MTMD_INPUT_CHUNK_TYPE_TEXT, MTMD_INPUT_CHUNK_TYPE_IMAGE, MTMD_INPUT_CHUNK_TYPE_AUDIO, ...
};
typedef struct mtmd_context      mtmd_context;
typedef struct mtmd_bitmap       mtmd_bitmap;
typedef struct mtmd_image_tokens mtmd_image_tokens;
typedef struct mtmd_input_chunk  mtmd_input_chunk;
typedef struct mtmd_input_chunks mtmd_input_chunks;

typedef struct mtmd_input_text {
    const char * text;
    size_t text_len;
    bool add_special;
    bool parse_special;
} mtmd_input_text;

struct mtmd_context_params {
    bool use_gpu;
    bool print_timings;
    int n_threads;
    const char * media_marker;
    enum llama_flash_attn_type flash_attn_type;
    bool warmup;
    int image_min_tokens;
    int image_max_tokens;
    ...;
};

struct mtmd_decoder_pos {
    uint32_t t;
    uint32_t x;
    uint32_t y;
    uint32_t z;
};

const char * mtmd_default_marker(void);
struct mtmd_context_params mtmd_context_params_default(void);
mtmd_context * mtmd_init_from_file(const char * mmproj_fname, const struct llama_model * text_model,
                                   const struct mtmd_context_params ctx_params);
void mtmd_free(mtmd_context * ctx);
bool mtmd_decode_use_non_causal(const mtmd_context * ctx, const mtmd_input_chunk * chunk);
bool mtmd_decode_use_mrope(const mtmd_context * ctx);
bool mtmd_support_vision(const mtmd_context * ctx);
bool mtmd_support_audio(const mtmd_context * ctx);
void mtmd_log_set(ggml_log_callback log_callback, void * user_data);

mtmd_bitmap * mtmd_bitmap_init(uint32_t nx, uint32_t ny, const unsigned char * data);
uint32_t mtmd_bitmap_get_nx(const mtmd_bitmap * bitmap);
uint32_t mtmd_bitmap_get_ny(const mtmd_bitmap * bitmap);
bool mtmd_bitmap_is_audio(const mtmd_bitmap * bitmap);
const char * mtmd_bitmap_get_id(const mtmd_bitmap * bitmap);
void mtmd_bitmap_set_id(mtmd_bitmap * bitmap, const char * id);
void mtmd_bitmap_free(mtmd_bitmap * bitmap);

mtmd_input_chunks * mtmd_input_chunks_init(void);
size_t mtmd_input_chunks_size(const mtmd_input_chunks * chunks);
const mtmd_input_chunk * mtmd_input_chunks_get(const mtmd_input_chunks * chunks, size_t idx);
void mtmd_input_chunks_free(mtmd_input_chunks * chunks);
enum mtmd_input_chunk_type mtmd_input_chunk_get_type(const mtmd_input_chunk * chunk);
const llama_token * mtmd_input_chunk_get_tokens_text(const mtmd_input_chunk * chunk, size_t * n_tokens_output);
const mtmd_image_tokens * mtmd_input_chunk_get_tokens_image(const mtmd_input_chunk * chunk);
size_t mtmd_input_chunk_get_n_tokens(const mtmd_input_chunk * chunk);
const char * mtmd_input_chunk_get_id(const mtmd_input_chunk * chunk);
llama_pos mtmd_input_chunk_get_n_pos(const mtmd_input_chunk * chunk);
mtmd_input_chunk * mtmd_input_chunk_copy(const mtmd_input_chunk * chunk);
void mtmd_input_chunk_free(mtmd_input_chunk * chunk);

size_t mtmd_image_tokens_get_n_tokens(const mtmd_image_tokens * image_tokens);
llama_pos mtmd_image_tokens_get_n_pos(const mtmd_image_tokens * image_tokens);
struct mtmd_decoder_pos mtmd_image_tokens_get_decoder_pos(const mtmd_image_tokens * image_tokens,
                                                          llama_pos pos_0, size_t i);

int32_t mtmd_tokenize(const mtmd_context * ctx, mtmd_input_chunks * output, const mtmd_input_text * text,
                      const mtmd_bitmap * const * bitmaps, size_t n_bitmaps);
int32_t mtmd_encode_chunk(mtmd_context * ctx, const mtmd_input_chunk * chunk);
float * mtmd_get_output_embd(mtmd_context * ctx);

/* mtmd-helper.h */
struct mtmd_helper_embd_batch {
    int32_t n_tokens;
    const float     * embd;
    int32_t           n_embd;
    const llama_pos * pos;
    int32_t           n_pos;
    llama_seq_id      seq_id;
};
typedef int32_t (*mtmd_helper_post_decode_callback)(const struct mtmd_helper_embd_batch * batch, void * user_data);

void mtmd_helper_log_set(ggml_log_callback log_callback, void * user_data);
size_t mtmd_helper_get_n_tokens(const mtmd_input_chunks * chunks);
llama_pos mtmd_helper_get_n_pos(const mtmd_input_chunks * chunks);
void mtmd_helper_image_get_decoder_pos(const mtmd_image_tokens * image, llama_pos pos_0, struct mtmd_decoder_pos * out_pos);
int32_t mtmd_helper_decode_image_chunk(mtmd_context * ctx, struct llama_context * lctx, const mtmd_input_chunk * chunk,
                                       float * encoded_embd, llama_pos n_past, llama_seq_id seq_id, int32_t n_batch,
                                       llama_pos * new_n_past, mtmd_helper_post_decode_callback callback, void * user_data);

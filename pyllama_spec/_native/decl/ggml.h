/* cffi declarations: the parts of ggml.h / ggml-backend.h we use.
 * Compiled in API mode against the real headers, so any drift is a build error. */
enum ggml_log_level {
    GGML_LOG_LEVEL_NONE, GGML_LOG_LEVEL_DEBUG, GGML_LOG_LEVEL_INFO,
    GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT, ...
};
typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
typedef bool (*ggml_abort_callback)(void * data);
enum ggml_type {
    GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1,
    GGML_TYPE_Q8_0, GGML_TYPE_IQ4_NL, GGML_TYPE_BF16, ...
};

typedef struct ggml_backend_device * ggml_backend_dev_t;
typedef struct ggml_backend_reg * ggml_backend_reg_t;
enum ggml_backend_dev_type {
    GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU,
    GGML_BACKEND_DEVICE_TYPE_IGPU, GGML_BACKEND_DEVICE_TYPE_ACCEL, ...
};
size_t                     ggml_backend_dev_count(void);
ggml_backend_dev_t         ggml_backend_dev_get(size_t index);
const char *               ggml_backend_dev_name(ggml_backend_dev_t device);
const char *               ggml_backend_dev_description(ggml_backend_dev_t device);
void                       ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
size_t                     ggml_backend_reg_count(void);
ggml_backend_reg_t         ggml_backend_reg_get(size_t index);
const char *               ggml_backend_reg_name(ggml_backend_reg_t reg);

/* devices by name and by registry: local ones are registered; remote (RPC) ones come from
 * the registry ggml_backend_rpc_add_server returns (reached through the RPC registry's
 * proc address, as llama.cpp's common/arg.cpp does, so a build without RPC still links) */
typedef struct ggml_backend_buffer_type * ggml_backend_buffer_type_t;
ggml_backend_reg_t         ggml_backend_reg_by_name(const char * name);
void *                     ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
size_t                     ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
ggml_backend_dev_t         ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
ggml_backend_reg_t         ggml_backend_dev_backend_reg(ggml_backend_dev_t device);
ggml_backend_buffer_type_t ggml_backend_dev_buffer_type(ggml_backend_dev_t device);
ggml_backend_buffer_type_t ggml_backend_cpu_buffer_type(void);

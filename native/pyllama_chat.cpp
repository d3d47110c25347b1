// llama.cpp's common chat layer (common/chat.h) behind a C API that speaks JSON, so that a chat
// request is rendered, constrained and parsed here exactly as llama-server does it: the template
// (with tools, tool results, reasoning, media markers), the grammar it builds (lazy, with its
// triggers), the reasoning budget, and the parser of the model's output (content, reasoning,
// tool calls) with llama-server's streaming diffs. Every C++ exception stays on this side: a
// failing call returns NULL (or -1) and leaves the reason in pyllama_last_error().
#include "pyllama_shim.h"
#include "pyllama_shim_internal.h"

#include "chat.h"
#include "common.h"
#include "json.h"
#include "llama-grammar.h"
#include "reasoning-budget.h"

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using json = common_json;

struct pyllama_chat_templates {
    common_chat_templates_ptr tmpls;
};

struct pyllama_chat_parser {
    common_chat_parser_params params;
    std::string               generated_text;
    common_chat_msg           chat_msg;
    std::vector<std::string>  tool_call_ids;
};

namespace {

char * to_c(const std::string & s) {
    char * out = static_cast<char *>(std::malloc(s.size() + 1));
    if (out != nullptr) {
        std::memcpy(out, s.data(), s.size());
        out[s.size()] = '\0';
    }
    return out;
}

// llama-server's random_string (tools/server/server-common.cpp): the ids of its tool calls.
std::string random_id() {
    static const std::string chars("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz");
    std::random_device rd;
    std::mt19937       generator(rd());
    std::string        result(32, ' ');
    for (int i = 0; i < 32; ++i) {
        result[i] = chars[generator() % chars.size()];
    }
    return result;
}

// server_chat_msg_diff_to_json_oaicompat (tools/server/server-chat.cpp): one OpenAI delta.
json diff_to_json(const common_chat_msg_diff & diff) {
    json delta = json::object();
    if (!diff.reasoning_content_delta.empty()) {
        delta["reasoning_content"] = diff.reasoning_content_delta;
    }
    if (!diff.content_delta.empty()) {
        delta["content"] = diff.content_delta;
    }
    if (diff.tool_call_index != std::string::npos) {
        json tool_call = json::object();
        tool_call["index"] = diff.tool_call_index;
        if (!diff.tool_call_delta.id.empty()) {
            tool_call["id"]   = diff.tool_call_delta.id;
            tool_call["type"] = "function";
        }
        if (!diff.tool_call_delta.name.empty() || !diff.tool_call_delta.arguments.empty()) {
            json function = json::object();
            if (!diff.tool_call_delta.name.empty()) {
                function["name"] = diff.tool_call_delta.name;
            }
            if (!diff.tool_call_delta.arguments.empty()) {
                function["arguments"] = diff.tool_call_delta.arguments;
            }
            tool_call["function"] = function;
        }
        json calls = json::array();
        calls.push_back(tool_call);
        delta["tool_calls"] = calls;
    }
    return delta;
}

json string_list(const std::vector<std::string> & items) {
    json out = json::array();
    for (const auto & s : items) {
        out.push_back(s);
    }
    return out;
}

// ------------------------------------------------------------------ the chat constraint sampler

// common_sampler's grammar and reasoning budget (common/sampling.cpp), as one llama_sampler that
// sits in a sampler chain where the grammar would: the budget forces the end of thinking when it
// runs out; a lazy grammar sees no token while the model thinks, and the end of thinking is
// replayed into it (it may hold the grammar's trigger).
struct chat_constraint {
    llama_sampler * grmr    = nullptr;
    llama_sampler * rbudget = nullptr;
    bool            lazy    = false;
};

bool grammar_should_apply(const chat_constraint * c) {
    if (c->grmr == nullptr) {
        return false;
    }
    if (c->rbudget == nullptr || !c->lazy) {
        return true;
    }
    const auto state = common_reasoning_budget_get_state(c->rbudget);
    return state == REASONING_BUDGET_IDLE || state == REASONING_BUDGET_DONE;
}

const char * constraint_name(const llama_sampler *) {
    return "pyllama-chat-constraint";
}

void constraint_apply(llama_sampler * smpl, llama_token_data_array * cur_p) {
    auto * c = static_cast<chat_constraint *>(smpl->ctx);
    if (c->rbudget != nullptr) {
        llama_sampler_apply(c->rbudget, cur_p);
    }
    if (grammar_should_apply(c)) {
        llama_sampler_apply(c->grmr, cur_p);
    }
}

void constraint_accept(llama_sampler * smpl, llama_token token) {
    auto *     c              = static_cast<chat_constraint *>(smpl->ctx);
    const bool accept_grammar = grammar_should_apply(c);  // before the budget moves on
    if (c->rbudget != nullptr) {
        llama_sampler_accept(c->rbudget, token);
        const bool done = common_reasoning_budget_get_state(c->rbudget) == REASONING_BUDGET_DONE;
        if (c->grmr != nullptr && !accept_grammar && done) {
            const llama_tokens * end_seq = common_reasoning_budget_get_end_match(c->rbudget);
            if (end_seq != nullptr) {
                for (const llama_token t : *end_seq) {
                    llama_sampler_accept(c->grmr, t);
                }
            }
        }
    }
    if (accept_grammar) {
        llama_sampler_accept(c->grmr, token);
    }
}

void constraint_reset(llama_sampler * smpl) {
    auto * c = static_cast<chat_constraint *>(smpl->ctx);
    if (c->grmr != nullptr) {
        llama_sampler_reset(c->grmr);
    }
    if (c->rbudget != nullptr) {
        llama_sampler_reset(c->rbudget);
    }
}

llama_sampler * constraint_clone(const llama_sampler * smpl);

void constraint_free(llama_sampler * smpl) {
    auto * c = static_cast<chat_constraint *>(smpl->ctx);
    if (c->grmr != nullptr) {
        llama_sampler_free(c->grmr);
    }
    if (c->rbudget != nullptr) {
        llama_sampler_free(c->rbudget);
    }
    delete c;
}

llama_sampler_i constraint_iface = {
    /* .name              = */ constraint_name,
    /* .accept            = */ constraint_accept,
    /* .apply             = */ constraint_apply,
    /* .reset             = */ constraint_reset,
    /* .clone             = */ constraint_clone,
    /* .free              = */ constraint_free,
    /* .backend_init      = */ nullptr,
    /* .backend_accept    = */ nullptr,
    /* .backend_apply     = */ nullptr,
    /* .backend_set_input = */ nullptr,
    /* .backend_reset     = */ nullptr,
    /* .copy_state        = */ nullptr,
};

llama_sampler * constraint_clone(const llama_sampler * smpl) {
    const auto * c   = static_cast<const chat_constraint *>(smpl->ctx);
    auto *       out = new chat_constraint();
    out->lazy        = c->lazy;
    out->grmr        = c->grmr != nullptr ? llama_sampler_clone(c->grmr) : nullptr;
    out->rbudget     = c->rbudget != nullptr ? llama_sampler_clone(c->rbudget) : nullptr;
    return llama_sampler_init(&constraint_iface, out);
}

// llama-sampler.cpp's grammar sampler state (a struct of that file's own): the same members at this
// pin, read only for the grammar's stack count.
struct grammar_sampler_state {
    const llama_vocab * vocab;
    std::string         grammar_str;
    std::string         grammar_root;
    llama_grammar *     grammar;
};

}  // namespace

size_t pyllama::grammar_stacks(const llama_sampler * smpl, size_t * n_vocab) {
    if (smpl == nullptr) {
        return 0;
    }
    const std::string name = llama_sampler_name(smpl);
    if (name == "grammar") {
        const auto * state = static_cast<const grammar_sampler_state *>(smpl->ctx);
        const auto * g     = state->grammar;
        if (g == nullptr || g->vocab != state->vocab) {  // no grammar (yet), or not the layout mirrored here
            return 0;
        }
        if (g->vocab != nullptr) {
            *n_vocab = std::max(*n_vocab, (size_t) llama_vocab_n_tokens(g->vocab));
        }
        return g->stacks.size();
    }
    if (name == constraint_name(smpl)) {
        return grammar_stacks(static_cast<const chat_constraint *>(smpl->ctx)->grmr, n_vocab);
    }
    if (name == "chain") {
        size_t most = 0;
        for (int32_t i = 0; i < llama_sampler_chain_n(smpl); i++) {
            most = std::max(most, grammar_stacks(llama_sampler_chain_get(const_cast<llama_sampler *>(smpl), i), n_vocab));
        }
        return most;
    }
    return 0;
}

extern "C" {

void pyllama_string_free(char * s) {
    std::free(s);
}

struct pyllama_chat_templates * pyllama_chat_templates_init(const struct llama_model * model, const char * override_src) {
    const std::string src = override_src != nullptr ? override_src : "";
    if (model == nullptr && src.empty()) {
        pyllama::fail("chat templates without a model need the template's text");  // common asserts on it
        return nullptr;
    }
    try {
        auto * out = new pyllama_chat_templates();
        try {
            out->tmpls = common_chat_templates_init(model, src);
        } catch (...) {
            delete out;
            throw;
        }
        return out;
    } catch (const std::exception & e) {
        // common_chat_templates_init rethrows its parser's error as a plain std::exception (the
        // message is lost): parse the text again for it
        std::string reason = e.what();
        try {
            const char * text = src.empty() && model != nullptr ? llama_model_chat_template(model, nullptr) : src.c_str();
            if (text != nullptr) {
                common_chat_template again(text, "", "");
            }
        } catch (const std::exception & e2) {
            reason = e2.what();
        }
        pyllama::fail(reason.c_str());
        return nullptr;
    }
}

void pyllama_chat_templates_free(struct pyllama_chat_templates * t) {
    delete t;
}

// What llama-server reads of its templates at start: the capabilities (/props), the sources, whether
// the template can think (common_chat_templates_support_enable_thinking, only asked with Jinja), and
// common_chat_format_example, which llama-server renders to check the template works at all.
char * pyllama_chat_templates_info(const struct pyllama_chat_templates * t, bool use_jinja, const char * kwargs_json) {
    try {
        std::map<std::string, std::string> kwargs;
        const json                         given = json::parse(kwargs_json != nullptr ? kwargs_json : "{}");
        for (const auto & item : given.items()) {
            kwargs[item.key()] = item.value().get<std::string>();
        }
        json out  = json::object();
        json caps = json::object();
        for (const auto & kv : common_chat_templates_get_caps(t->tmpls.get())) {
            caps[kv.first] = kv.second;
        }
        out["caps"]              = caps;
        out["source"]            = common_chat_templates_source(t->tmpls.get(), "");
        out["tool_use_source"]   = common_chat_templates_source(t->tmpls.get(), "tool_use");
        out["example"]           = common_chat_format_example(t->tmpls.get(), use_jinja, kwargs);
        out["supports_thinking"] = use_jinja && common_chat_templates_support_enable_thinking(t->tmpls.get());
        return to_c(out.dump_safe());
    } catch (const std::exception & e) {
        pyllama::fail(e.what());
        return nullptr;
    }
}

// The steps of llama-server's oaicompat_chat_params_parse from common_chat_msgs_parse_oaicompat on:
// the request's fields have been read (and checked) by the caller.
char * pyllama_chat_templates_apply(const struct pyllama_chat_templates * t, const char * inputs_json) {
    try {
        const json                   in = json::parse(inputs_json);
        common_chat_templates_inputs inputs;
        inputs.messages = common_chat_msgs_parse_oaicompat(in.at("messages"));
        inputs.tools    = common_chat_tools_parse_oaicompat(in.value("tools", json()));
        inputs.tool_choice = common_chat_tool_choice_parse_oaicompat(in.value("tool_choice", std::string("auto")));
        const json schema  = in.value("json_schema", json());
        inputs.json_schema = schema.is_null() ? "" : schema.dump();
        inputs.grammar     = in.value("grammar", std::string());
        inputs.use_jinja   = in.value("use_jinja", true);
        inputs.parallel_tool_calls   = in.value("parallel_tool_calls", false);
        inputs.add_generation_prompt = in.value("add_generation_prompt", true);
        inputs.continue_final_message = in.contains("continue_final_message") ?
            common_chat_continuation_parse(in.at("continue_final_message")) : COMMON_CHAT_CONTINUATION_NONE;
        inputs.reasoning_format   = common_reasoning_format_from_name(in.value("reasoning_format", std::string("none")));
        inputs.enable_thinking    = in.value("enable_thinking", true);
        inputs.force_pure_content = in.value("force_pure_content", false);
        const json kwargs         = in.value("chat_template_kwargs", json::object());
        for (const auto & item : kwargs.items()) {
            inputs.chat_template_kwargs[item.key()] = item.value().get<std::string>();
        }

        const common_chat_params p = common_chat_templates_apply(t->tmpls.get(), inputs);

        json out = json::object();
        out["prompt"]             = p.prompt;
        out["format"]             = static_cast<int>(p.format);
        out["format_name"]        = common_chat_format_name(p.format);
        out["grammar"]            = p.grammar;
        out["grammar_lazy"]       = p.grammar_lazy;
        out["generation_prompt"]  = p.generation_prompt;
        out["supports_thinking"]  = p.supports_thinking;
        out["thinking_start_tag"] = p.thinking_start_tag;
        out["thinking_end_tags"]  = string_list(p.thinking_end_tags);
        json triggers             = json::array();
        for (const auto & trigger : p.grammar_triggers) {
            json tj     = json::object();
            tj["type"]  = static_cast<int>(trigger.type);
            tj["value"] = trigger.value;
            if (trigger.type == COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN) {
                tj["token"] = trigger.token;
            }
            triggers.push_back(tj);
        }
        out["grammar_triggers"] = triggers;
        out["preserved_tokens"] = string_list(p.preserved_tokens);
        out["additional_stops"] = string_list(p.additional_stops);
        out["parser"]           = p.parser;
        return to_c(out.dump_safe());
    } catch (const std::exception & e) {
        pyllama::fail(e.what());
        return nullptr;
    }
}

// llama-server's task_result_state for one generation (tools/server/server-task.cpp): the text so
// far, the message parsed from it, and the ids given to its tool calls.
struct pyllama_chat_parser * pyllama_chat_parser_init(const char * params_json) {
    try {
        const json in  = json::parse(params_json);
        auto *     out = new pyllama_chat_parser();
        try {
            auto & p                = out->params;
            p.format                = static_cast<common_chat_format>(in.value("format", 0));
            p.reasoning_format      = common_reasoning_format_from_name(in.value("reasoning_format", std::string("none")));
            p.reasoning_in_content  = in.value("reasoning_in_content", false);
            p.generation_prompt     = in.value("generation_prompt", std::string());
            p.is_continuation       = in.value("is_continuation", false);
            p.echo                  = in.value("echo", false);
            const std::string saved = in.value("parser", std::string());
            if (!saved.empty()) {
                p.parser.load(saved);
            }
            if (p.is_continuation && !p.echo) {
                // no delta for the assistant prefill itself
                out->chat_msg = common_chat_parse("", true, p);
            }
        } catch (...) {
            delete out;
            throw;
        }
        return out;
    } catch (const std::exception & e) {
        pyllama::fail(e.what());
        return nullptr;
    }
}

void pyllama_chat_parser_free(struct pyllama_chat_parser * p) {
    delete p;
}

// update_chat_msg(text_added, is_partial, diffs): {"message": the OpenAI message so far, "diffs":
// [OpenAI deltas since the last call]}. NULL when the text does not parse (the state is kept: a
// caller may add more text, or read the text as it is).
char * pyllama_chat_parser_update(struct pyllama_chat_parser * p, const char * text_added, size_t n, bool is_partial) {
    try {
        p->generated_text.append(text_added, n);
        const common_chat_msg previous = p->chat_msg;
        common_chat_msg       parsed   = common_chat_parse(p->generated_text, is_partial, p->params);
        json                  diffs    = json::array();
        if (!parsed.empty()) {
            parsed.set_tool_call_ids(p->tool_call_ids, random_id);
            for (const auto & d : common_chat_msg_diff::compute_diffs(previous, parsed)) {
                diffs.push_back(diff_to_json(d));
            }
            p->chat_msg = parsed;
        }
        json out       = json::object();
        out["message"] = p->chat_msg.to_json_oaicompat();
        out["diffs"]   = diffs;
        return to_c(out.dump_safe());
    } catch (const std::exception & e) {
        pyllama::fail(e.what());
        return nullptr;
    }
}

// common_sampler_init's grammar, trigger and reasoning-budget steps (common/sampling.cpp) and
// server-schema.cpp's reading of the triggers and preserved tokens, from a JSON spec:
// {"grammar", "lazy", "triggers": [{"type", "value"}], "preserved_tokens", "generation_prompt",
//  "prefill_grammar", "reasoning_budget": {"tokens", "start", "end": [...], "message"} | null}.
struct llama_sampler * pyllama_sampler_init_chat_constraint(const struct llama_vocab * vocab, const char * spec_json) {
    llama_sampler * grmr    = nullptr;
    llama_sampler * rbudget = nullptr;
    try {
        const json        spec    = json::parse(spec_json);
        const std::string grammar = spec.value("grammar", std::string());
        const bool        lazy    = spec.value("lazy", false);

        std::vector<llama_token> preserved;
        for (const auto & t : spec.value("preserved_tokens", json::array())) {
            auto ids = common_tokenize(vocab, t.get<std::string>(), false, true);
            if (ids.size() == 1) {
                preserved.push_back(ids[0]);
            }
        }
        std::vector<std::string> patterns;
        std::vector<llama_token> trigger_tokens;
        for (const auto & t : spec.value("triggers", json::array())) {
            const auto        type  = static_cast<common_grammar_trigger_type>(t.value("type", 0));
            const std::string value = t.value("value", std::string());
            switch (type) {
                case COMMON_GRAMMAR_TRIGGER_TYPE_WORD: {
                    auto ids = common_tokenize(vocab, value, false, true);
                    if (ids.size() == 1) {
                        if (std::find(preserved.begin(), preserved.end(), ids[0]) == preserved.end()) {
                            throw std::runtime_error("Grammar trigger word should be marked as preserved token: " + value);
                        }
                        trigger_tokens.push_back(ids[0]);
                    } else {
                        patterns.push_back(regex_escape(value));
                    }
                    break;
                }
                case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN:
                    patterns.push_back(value);
                    break;
                case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL: {
                    std::string anchored = "^$";
                    if (!value.empty()) {
                        anchored = (value.front() != '^' ? "^" : "") + value + (value.back() != '$' ? "$" : "");
                    }
                    patterns.push_back(anchored);
                    break;
                }
                case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN:
                    trigger_tokens.push_back(t.value("token", (int) LLAMA_TOKEN_NULL));
                    break;
                default:
                    throw std::runtime_error("unknown grammar trigger type");
            }
        }
        if (lazy && patterns.empty() && trigger_tokens.empty()) {
            throw std::runtime_error("Error: no triggers set for lazy grammar!");
        }

        if (!grammar.empty()) {
            if (lazy) {
                std::vector<const char *> c_patterns;
                for (const auto & s : patterns) {
                    c_patterns.push_back(s.c_str());
                }
                grmr = llama_sampler_init_grammar_lazy_patterns(vocab, grammar.c_str(), "root", c_patterns.data(),
                                                                c_patterns.size(), trigger_tokens.data(),
                                                                trigger_tokens.size());
            } else {
                grmr = llama_sampler_init_grammar(vocab, grammar.c_str(), "root");
            }
            if (grmr == nullptr) {
                throw std::runtime_error("failed to parse grammar");
            }
        }

        // the generation prompt's tokens, less a leading space some tokenizers add
        std::vector<llama_token> prefill;
        const std::string        gen_prompt = spec.value("generation_prompt", std::string());
        if (!gen_prompt.empty()) {
            auto tokens = common_tokenize(vocab, gen_prompt, false, true);
            for (size_t i = 0; i < tokens.size(); i++) {
                const std::string piece = common_token_to_piece(vocab, tokens[i], true);
                if (i == 0 && !piece.empty() && std::isspace((unsigned char) piece[0]) &&
                    !std::isspace((unsigned char) gen_prompt[0])) {
                    continue;
                }
                prefill.push_back(tokens[i]);
            }
        }
        if (grmr != nullptr && !lazy && spec.value("prefill_grammar", false)) {
            for (const auto token : prefill) {
                llama_sampler_accept(grmr, token);
            }
        }

        const json budget = spec.value("reasoning_budget", json());
        if (budget.is_object()) {
            const int32_t n_budget = budget.value("tokens", -1);
            const auto    start    = common_tokenize(vocab, budget.value("start", std::string()), false, true);
            std::vector<llama_tokens> ends;
            for (const auto & tag : budget.value("end", json::array())) {
                const std::string s = tag.get<std::string>();
                if (!s.empty()) {
                    ends.push_back(common_tokenize(vocab, s, false, true));
                }
            }
            llama_tokens forced;
            if (!ends.empty()) {
                forced                    = ends.front();
                const std::string message = budget.value("message", std::string());
                if (!message.empty()) {
                    auto msg = common_tokenize(vocab, message, false, true);
                    forced.insert(forced.begin(), msg.begin(), msg.end());
                }
            }
            if (!start.empty() && !ends.empty() && (lazy || n_budget >= 0)) {
                rbudget = common_reasoning_budget_init(vocab, { start }, ends, forced, n_budget < 0 ? INT_MAX : n_budget);
                for (const auto token : prefill) {
                    llama_sampler_accept(rbudget, token);
                }
            }
        }
        if (grmr == nullptr && rbudget == nullptr) {
            pyllama::fail("");  // nothing to constrain: NULL with an empty reason
            return nullptr;
        }
        auto * c    = new chat_constraint();
        c->grmr     = grmr;
        c->rbudget  = rbudget;
        c->lazy     = lazy;
        return llama_sampler_init(&constraint_iface, c);
    } catch (const std::exception & e) {
        if (grmr != nullptr) {
            llama_sampler_free(grmr);
        }
        if (rbudget != nullptr) {
            llama_sampler_free(rbudget);
        }
        pyllama::fail(e.what());
        return nullptr;
    }
}

}

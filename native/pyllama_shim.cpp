// Thin extern "C" forwarding, plus the one piece of logic that must be native: noticing
// Ctrl-C while a long native call runs (Python's own handler only runs between bytecodes).
#include "pyllama_shim.h"
#include "pyllama_shim_internal.h"

#include "json-schema-to-grammar.h"
#include "llama-ext.h"
#include "llama-grammar.h"
#include "mtmd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <csignal>
#include <cstring>
#include <string>
#include <vector>

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

const int32_t * pyllama_model_target_layer_ids(const llama_model * model) {
    return llama_model_target_layer_ids(model);
}

uint32_t pyllama_model_target_layer_ids_n(const llama_model * model) {
    return llama_model_target_layer_ids_n(model);
}

int32_t pyllama_model_dflash_selector_top_k(const llama_model * model) {
    return llama_model_dflash_selector_top_k(model);
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

// ----------------------------------------------------------------------------- chain drafting

namespace {

// The most likely token of a logits row (the first of equal ones; NaN logits are never chosen), and
// whether its probability among the top_k most likely (top_k <= 0: all of them) reaches p_min, as
// llama.cpp's top-k sampler reports it: softmax over those k, summed from the largest down. ``top``
// is the caller's scratch space, reused from row to row.
bool chain_choice(const float * row, int32_t n_vocab, int32_t top_k, float p_min, std::vector<float> & top,
                  int32_t & best) {
    best = 0;
    for (int32_t v = 1; v < n_vocab; ++v) {
        if (row[v] > row[best] || std::isnan(row[best])) {
            best = v;
        }
    }
    if (std::isnan(row[best])) {
        return false;  // every logit is NaN: nothing to choose
    }
    if (p_min <= 0.0f) {
        return true;
    }
    // a small min-heap of the k largest logits: O(n_vocab log k)
    const size_t k = (size_t) (top_k > 0 ? std::min(top_k, n_vocab) : n_vocab);
    top.clear();
    const auto greater = [](float a, float b) { return a > b; };
    for (int32_t v = 0; v < n_vocab; ++v) {
        const float x = row[v];
        if (std::isnan(x)) {
            continue;
        }
        if (top.size() < k) {
            top.push_back(x);
            std::push_heap(top.begin(), top.end(), greater);
        } else if (x > top.front()) {
            std::pop_heap(top.begin(), top.end(), greater);
            top.back() = x;
            std::push_heap(top.begin(), top.end(), greater);
        }
    }
    std::sort_heap(top.begin(), top.end(), greater);  // largest first
    float sum = 0.0f;
    for (const float x : top) {
        sum += std::exp(x - row[best]);
    }
    return sum > 0.0f && 1.0f / sum >= p_min;
}

}  // namespace

int32_t pyllama_draft_chain(llama_context * ctx, llama_batch_ext * batch, int32_t n_seq, const int32_t * seq_ids,
                            const int32_t * next_pos, const int32_t * n_max, int32_t max_n, float p_min,
                            int32_t top_k, bool feed_states, int32_t n_vocab, int32_t n_embd, int32_t * tokens,
                            float * logits, int32_t * n_drafted, int32_t * n_last_rows) {
    // active[j]: the sequence (index into seq_ids) of the batch's j-th output row
    std::vector<int32_t> active, going;
    std::vector<float> top;
    for (int32_t i = 0; i < n_seq; ++i) {
        active.push_back(i);
        n_drafted[i] = 0;
    }
    *n_last_rows = 0;
    int32_t rc = 0;
    for (int32_t step = 0; !active.empty() && rc == 0; ++step) {
        rc = llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch);
        if (rc != 0) {
            break;
        }
        *n_last_rows = (int32_t) active.size();
        const float * rows = llama_get_logits(ctx);
        const float * states = feed_states ? llama_get_embeddings_nextn(ctx) : nullptr;
        if (rows == nullptr || (feed_states && states == nullptr)) {
            rc = -100;
            break;
        }
        llama_batch_ext_clear(batch);
        going.clear();
        for (size_t j = 0; j < active.size() && rc == 0; ++j) {
            const int32_t i = active[j];
            const float * row = rows + j * (size_t) n_vocab;
            int32_t tok = 0;
            if (n_drafted[i] >= n_max[i] || !chain_choice(row, n_vocab, top_k, p_min, top, tok)) {
                continue;  // no room, or not sure enough: this sequence's draft ends before this token
            }
            const int32_t k = n_drafted[i]++;
            tokens[(size_t) i * max_n + k] = tok;
            if (logits != nullptr) {
                std::memcpy(logits + ((size_t) i * max_n + k) * n_vocab, row, sizeof(float) * n_vocab);
            }
            if (n_drafted[i] >= n_max[i]) {
                continue;
            }
            // the drafted token goes back in at the sequence's next position (with this row's
            // output embedding as its state, for EAGLE3 and MTP)
            const int32_t idx = llama_batch_ext_add_token(batch, seq_ids[i], tok);
            if (idx < 0) {
                rc = -200 + idx;
                break;
            }
            const llama_pos pos = next_pos[i] + step;
            bool ok = llama_batch_ext_set_pos(batch, idx, &pos) && llama_batch_ext_set_output_logits(batch, idx, true);
            if (ok && feed_states) {
                llama_embd state = { states + j * (size_t) n_embd, 1, (size_t) n_embd };
                ok = llama_batch_ext_set_embd_token(batch, idx, state);
            }
            if (!ok) {
                rc = -204;
                break;
            }
            going.push_back(i);
        }
        active.swap(going);
    }
    llama_batch_ext_clear(batch);  // whatever ended the chain, the batch holds nothing of it
    return rc;
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

// ----------------------------------------------------------------------------- constrained output

namespace {
thread_local std::string g_last_error;

int32_t failed(const char * what) {
    g_last_error = what;
    return -1;
}

// llama-grammar.cpp's parse_space (a static function there): blanks and # comments.
const char * skip_space(const char * pos) {
    while (*pos == ' ' || *pos == '\t' || *pos == '#' || *pos == '\r' || *pos == '\n') {
        if (*pos == '#') {
            while (*pos && *pos != '\r' && *pos != '\n') {
                pos++;
            }
        } else {
            pos++;
        }
    }
    return pos;
}

// What llama.cpp's grammar engine will do with the parsed rules, counted before it does it:
// `stacks`, the most stacks one advance of a stack makes (llama_grammar_advance_stack expands every
// reference and every way to skip what may be empty, down to the next terminal), and `after_char`,
// the most stacks accepting one character from one stack makes (each of those terminals, matched,
// advanced again). The engine's work grows with these (a duplicate check scans the stacks it has:
// quadratic in them; sampling repeats it per candidate token): `root ::= (.?){400} "b"` is 20
// bytes and 80,200 paths after a character. Counted as paths (an upper bound of the distinct stacks),
// in time linear in the rules: with whether it may be empty N (0 or 1), the first terminals' paths E,
// the paths that finish what they start on one character Z, and those paths' paths after it A, a
// sequence's values follow from its elements' (a reference's from its rule's, each rule's from its
// alternatives'). A rule's values depend on the rules it starts with through what may be empty. Rules
// that start with each other form a group; where a group's rule starts with one of the group other than
// last in an alternative, every turn pushes (left recursion, which llama.cpp's own check misses when a
// rule is empty only through another: its engine then grows stacks until the memory is gone), and
// rule_counts refuses the grammar.
struct grammar_paths {
    const llama_grammar_rules & rules;
    std::vector<double> N, E, Z, A;         // per rule
    std::vector<std::vector<double>> pN, pE; // per element: the values of the sequence from it
    // the rules in groups that start with each other (strongly connected through what they start with),
    // each group after the groups its rules start with
    std::vector<std::vector<uint32_t>> groups;
    std::vector<uint32_t> group_of;
    double stacks = 0.0, after_char = 0.0;

    static double cap(double x) { return x < 1e30 ? x : 1e30; }  // no inf: inf * 0 would be NaN
    static bool is_end(const llama_grammar_element & e) {
        return e.type == LLAMA_GRETYPE_END || e.type == LLAMA_GRETYPE_ALT;
    }
    static bool is_modifier(const llama_grammar_element & e) {
        return e.type == LLAMA_GRETYPE_CHAR_ALT || e.type == LLAMA_GRETYPE_CHAR_RNG_UPPER;
    }
    // the element after the one at i (a character class's ranges and alternatives belong to it)
    size_t next(const llama_grammar_rule & rule, size_t i) const {
        i++;
        while (i < rule.size() && is_modifier(rule[i])) {
            i++;
        }
        return i;
    }

    // Whether each rule may be empty: the least fixpoint, each reference counted down once when its rule
    // turns out to be empty (linear in the rules).
    void may_be_empty() {
        const size_t n = rules.size();
        N.assign(n, 0.0);
        struct alternative { uint32_t rule; size_t refs_left; bool has_terminal; };
        std::vector<alternative> alts;
        std::vector<std::vector<uint32_t>> occurs_in(n);  // the alternatives each rule is referenced in
        for (uint32_t r = 0; r < n; r++) {
            const llama_grammar_rule & rule = rules[r];
            if (rule.empty()) {
                continue;
            }
            alts.push_back({r, 0, false});
            for (size_t i = 0; i < rule.size(); i = is_end(rule[i]) ? i + 1 : next(rule, i)) {
                if (rule[i].type == LLAMA_GRETYPE_ALT) {
                    alts.push_back({r, 0, false});
                } else if (rule[i].type == LLAMA_GRETYPE_RULE_REF) {
                    alts.back().refs_left++;
                    occurs_in[rule[i].value].push_back((uint32_t) (alts.size() - 1));
                } else if (!is_end(rule[i])) {
                    alts.back().has_terminal = true;
                }
            }
        }
        std::vector<uint32_t> todo;
        for (const alternative & a : alts) {
            if (!a.has_terminal && a.refs_left == 0 && N[a.rule] == 0.0) {
                N[a.rule] = 1.0;
                todo.push_back(a.rule);
            }
        }
        while (!todo.empty()) {
            const uint32_t s = todo.back();
            todo.pop_back();
            for (uint32_t k : occurs_in[s]) {
                alternative & a = alts[k];
                if (!a.has_terminal && --a.refs_left == 0 && N[a.rule] == 0.0) {
                    N[a.rule] = 1.0;
                    todo.push_back(a.rule);
                }
            }
        }
    }

    // The references each rule starts with (through what may be empty), each marked when it is the last
    // of its alternative (nothing pushed: the engine's stack goes on as it was).
    struct start_ref { uint32_t rule; bool last; };
    std::vector<std::vector<start_ref>> starts_with() const {
        std::vector<std::vector<start_ref>> out(rules.size());
        for (uint32_t r = 0; r < rules.size(); r++) {
            const llama_grammar_rule & rule = rules[r];
            bool open = true;  // still at the start of this alternative, through what may be empty
            for (size_t i = 0; i < rule.size(); i = is_end(rule[i]) ? i + 1 : next(rule, i)) {
                if (is_end(rule[i])) {
                    open = true;
                } else if (open && rule[i].type == LLAMA_GRETYPE_RULE_REF) {
                    out[r].push_back({rule[i].value, is_end(rule[i + 1])});
                    open = N[rule[i].value] != 0.0;
                } else {
                    open = false;
                }
            }
        }
        return out;
    }

    // Groups the rules that start with each other (Tarjan's strongly connected components, without
    // recursion), each group after those its rules start with. False where a group starts with one of
    // its own rules other than last in an alternative: left recursion, whose every turn pushes.
    bool group_rules(const std::vector<std::vector<start_ref>> & refs) {
        const size_t n = rules.size();
        const uint32_t unseen = UINT32_MAX;
        std::vector<uint32_t> index(n, unseen), low(n, 0);
        std::vector<uint8_t> on_stack(n, 0);
        std::vector<uint32_t> stack;
        group_of.assign(n, unseen);
        uint32_t next_index = 0;
        struct frame { uint32_t rule; size_t edge; };
        for (uint32_t root = 0; root < n; root++) {
            if (index[root] != unseen) {
                continue;
            }
            std::vector<frame> todo{{root, 0}};
            index[root] = low[root] = next_index++;
            stack.push_back(root);
            on_stack[root] = 1;
            while (!todo.empty()) {
                frame & f = todo.back();
                if (f.edge < refs[f.rule].size()) {
                    const uint32_t s = refs[f.rule][f.edge++].rule;
                    if (index[s] == unseen) {
                        index[s] = low[s] = next_index++;
                        stack.push_back(s);
                        on_stack[s] = 1;
                        todo.push_back({s, 0});  // f may dangle now: not used below
                    } else if (on_stack[s]) {
                        low[f.rule] = std::min(low[f.rule], index[s]);
                    }
                    continue;
                }
                const uint32_t r = f.rule;
                todo.pop_back();
                if (!todo.empty()) {
                    low[todo.back().rule] = std::min(low[todo.back().rule], low[r]);
                }
                if (low[r] == index[r]) {
                    groups.emplace_back();
                    uint32_t m;
                    do {
                        m = stack.back();
                        stack.pop_back();
                        on_stack[m] = 0;
                        group_of[m] = (uint32_t) (groups.size() - 1);
                        groups.back().push_back(m);
                    } while (m != r);
                }
            }
        }
        for (uint32_t r = 0; r < n; r++) {
            for (const start_ref & ref : refs[r]) {
                if (group_of[ref.rule] == group_of[r] && !ref.last) {
                    return false;
                }
            }
        }
        return true;
    }

    // N and E of every rule. The rules of a group start with each other last in their alternatives,
    // pushing nothing: from any of them the engine reaches the first terminals of all, so each gets the
    // group's sum (references within the group add nothing more).
    bool rule_counts() {
        may_be_empty();
        if (!group_rules(starts_with())) {
            return false;
        }
        E.assign(rules.size(), 0.0);
        for (const auto & group : groups) {
            double e = 0.0;
            for (uint32_t r : group) {
                const llama_grammar_rule & rule = rules[r];
                bool open = true;
                for (size_t i = 0; i < rule.size(); i = is_end(rule[i]) ? i + 1 : next(rule, i)) {
                    const llama_grammar_element & el = rule[i];
                    if (is_end(el)) {
                        open = true;
                    } else if (!open) {
                        continue;
                    } else if (el.type != LLAMA_GRETYPE_RULE_REF) {
                        e = cap(e + 1.0);
                        open = false;
                    } else if (group_of[el.value] == group_of[r]) {
                        open = false;  // last in its alternative: counted with the group
                    } else {
                        e = cap(e + E[el.value]);
                        open = N[el.value] != 0.0;
                    }
                }
            }
            for (uint32_t r : group) {
                E[r] = e;
            }
        }
        return true;
    }

    // N and E of the sequence from every element, each alternative read backwards.
    void element_counts() {
        pN.resize(rules.size()); pE.resize(rules.size());
        for (size_t r = 0; r < rules.size(); r++) {
            const llama_grammar_rule & rule = rules[r];
            pN[r].assign(rule.size(), 0.0); pE[r].assign(rule.size(), 0.0);
            double n_next = 1.0, e_next = 0.0;
            for (size_t i = rule.size(); i-- > 0;) {
                const llama_grammar_element & e = rule[i];
                if (is_end(e)) {
                    n_next = 1.0; e_next = 0.0;
                } else if (is_modifier(e)) {
                    continue;  // part of the terminal before it
                } else if (e.type == LLAMA_GRETYPE_RULE_REF) {
                    e_next = cap(E[e.value] + N[e.value] * e_next);
                    n_next = cap(N[e.value] * n_next);
                } else {
                    n_next = 0.0; e_next = 1.0;
                }
                pN[r][i] = n_next; pE[r][i] = e_next;
                stacks = std::max(stacks, e_next);
            }
        }
    }

    // Z and A of every rule (group by group, as E), then A of the sequence from every element, whose
    // largest is `after_char`.
    void after_one_char() {
        const size_t n = rules.size();
        Z.assign(n, 0.0); A.assign(n, 0.0);
        for (const auto & group : groups) {
            double z = 0.0, a = 0.0;
            for (uint32_t r : group) {
                const llama_grammar_rule & rule = rules[r];
                bool open = true;
                for (size_t i = 0; i < rule.size();) {
                    const llama_grammar_element & e = rule[i];
                    if (is_end(e)) {
                        open = true; i++;
                        continue;
                    }
                    const size_t q = next(rule, i);
                    if (open) {
                        if (e.type != LLAMA_GRETYPE_RULE_REF) {
                            z = cap(z + pN[r][q]);
                            a = cap(a + pE[r][q]);
                            open = false;
                        } else if (group_of[e.value] == group_of[r]) {
                            open = false;  // last in its alternative: counted with the group
                        } else {
                            const uint32_t s = e.value;
                            z = cap(z + Z[s] * pN[r][q]);
                            a = cap(a + A[s] + Z[s] * pE[r][q]);
                            open = N[s] != 0.0;
                        }
                    }
                    i = q;
                }
            }
            for (uint32_t r : group) {
                Z[r] = z; A[r] = a;
            }
        }
        for (size_t r = 0; r < n; r++) {
            const llama_grammar_rule & rule = rules[r];
            double a_next = 0.0;
            for (size_t i = rule.size(); i-- > 0;) {
                const llama_grammar_element & e = rule[i];
                if (is_end(e)) {
                    a_next = 0.0;
                } else if (is_modifier(e)) {
                    continue;
                } else {
                    const size_t q = next(rule, i);
                    const double e_after = q < rule.size() ? pE[r][q] : 0.0;
                    if (e.type == LLAMA_GRETYPE_RULE_REF) {
                        const uint32_t s = e.value;
                        a_next = cap(A[s] + Z[s] * e_after + N[s] * a_next);
                    } else {
                        a_next = e_after;
                    }
                    after_char = std::max(after_char, a_next);
                }
            }
        }
    }
};
}  // namespace

}  // extern "C"

int32_t pyllama::fail(const char * what) {
    return failed(what);
}

extern "C" {

const char * pyllama_last_error(void) {
    return g_last_error.c_str();
}

// llama_grammar_parser::parse prints its error to stderr and returns false; the same steps
// here keep the reason for the caller.
int32_t pyllama_grammar_check(const char * gbnf, double * cost) {
    try {
        llama_grammar_parser parser;
        const char * pos = skip_space(gbnf);
        while (*pos) {
            pos = parser.parse_rule(pos);
        }
        for (const auto & rule : parser.rules) {
            if (rule.empty()) {
                return failed("undefined rule");
            }
            for (const auto & elem : rule) {
                if (elem.type == LLAMA_GRETYPE_RULE_REF &&
                    (elem.value >= parser.rules.size() || parser.rules[elem.value].empty())) {
                    for (const auto & kv : parser.symbol_ids) {
                        if (kv.second == elem.value) {
                            return failed(("undefined rule identifier '" + kv.first + "'").c_str());
                        }
                    }
                    return failed("undefined rule");
                }
            }
        }
        // "root" named but never defined (only repeated zero times: `r ::= root{0}`) has a symbol id and
        // no rule: llama_grammar_init_impl would read past the rules and crash
        const auto root = parser.symbol_ids.find("root");
        if (root == parser.symbol_ids.end() || root->second >= parser.rules.size() ||
                parser.rules[root->second].empty()) {
            return failed("the grammar has no 'root' rule");
        }
        if (cost != nullptr) {
            grammar_paths paths{parser.rules};
            cost[0] = cost[1] = cost[2] = -1.0;  // left recursion
            if (paths.rule_counts()) {
                paths.element_counts();
                paths.after_one_char();
                cost[0] = paths.stacks;
                cost[1] = paths.after_char;
                cost[2] = paths.E[root->second] + paths.N[root->second];  // the first advance, the empty stack too
            }
        }
        return 0;
    } catch (const std::exception & e) {
        return failed(e.what());
    }
}

// After a token is accepted: refuse to go on when the grammar's engine follows more stacks than
// the limits allow. Sampling walks the candidate tokens once per stack (about 4 ms a stack a token on
// a vocabulary of 262,144), and an ambiguous grammar of a few bytes doubles them at every token
// (`r ::= "a" r "b" | "a" r "c" | "d"` after a run of "a"s: 2^n), which the static count of
// pyllama_grammar_check cannot see: it depends on the text. Two limits: the stacks, and the stacks
// times the grammar's vocabulary (the candidates checked a token).
static size_t g_max_grammar_stacks = SIZE_MAX;
static double g_max_grammar_work   = INFINITY;

static int32_t check_grammar_stacks(const llama_sampler * smpl) {
    size_t n_vocab = 0;
    const size_t n = pyllama::grammar_stacks(smpl, &n_vocab);
    const double work = (double) n * (double) n_vocab;
    if (n > g_max_grammar_stacks || work > g_max_grammar_work) {
        const double per_vocab = n_vocab > 0 ? g_max_grammar_work / (double) n_vocab : INFINITY;
        const size_t most = std::min(g_max_grammar_stacks, per_vocab < 1e18 ? (size_t) per_vocab : SIZE_MAX);
        const std::string what = "the grammar's engine would follow " + std::to_string(n) +
            " paths at once after this token (at most " + std::to_string(most) + " with a vocabulary of " +
            std::to_string(n_vocab) + " tokens): the grammar is too ambiguous for the text so far "
            "(alternatives that begin alike inside a recursion, or many optional items in a row, multiply them)";
        return failed(what.c_str());
    }
    return 0;
}

void pyllama_grammar_limit(size_t max_stacks, double max_stacks_times_vocab) {
    g_max_grammar_stacks = max_stacks;
    g_max_grammar_work   = max_stacks_times_vocab;
}

// llama_sampler_sample's steps (CPU samplers only: this package sets no backend sampler), with
// two checks it makes by aborting or not at all: a row without logits, and a pick that every
// sampler forbade (a grammar and a logit bias that leave no token: llama.cpp would accept the
// forbidden token, or abort on an end-of-generation token the grammar cannot take yet).
int32_t pyllama_sampler_sample(llama_sampler * smpl, llama_context * ctx, int32_t idx) {
    thread_local std::vector<llama_token_data> cur;
    try {
        const float * logits = llama_get_logits_ith(ctx, idx);
        if (logits == nullptr) {
            return failed("no logits at this output row");
        }
        const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
        cur.resize(n_vocab);
        for (llama_token t = 0; t < n_vocab; t++) {
            cur[t] = llama_token_data{t, logits[t], 0.0f};
        }
        llama_token_data_array cur_p = {cur.data(), cur.size(), -1, false};
        llama_sampler_apply(smpl, &cur_p);
        if (cur_p.selected < 0 || cur_p.selected >= (int64_t) cur_p.size) {
            return failed("the samplers selected no token");
        }
        const llama_token_data & picked = cur_p.data[cur_p.selected];
        if (picked.logit == -INFINITY) {
            return failed("no token is allowed here: the grammar and the logit bias forbid every one");
        }
        llama_sampler_accept(smpl, picked.id);
        if (check_grammar_stacks(smpl) != 0) {
            return -1;
        }
        return picked.id;
    } catch (const std::exception & e) {
        return failed(e.what());
    }
}

int32_t pyllama_sampler_accept(llama_sampler * smpl, int32_t token) {
    try {
        llama_sampler_accept(smpl, token);
        return check_grammar_stacks(smpl);
    } catch (const std::exception & e) {
        return failed(e.what());
    }
}

int64_t pyllama_json_schema_to_grammar(const char * schema_json, char * out, size_t n_out) {
    try {
        common_json schema = common_json::parse(schema_json);
        if (schema.is_object() && schema.empty()) {
            schema["type"] = "object";  // llama-server: an empty schema means any object
        }
        const std::string gbnf = json_schema_to_grammar(schema);
        if (out != nullptr && n_out > 0) {
            const size_t n = std::min(gbnf.size(), n_out - 1);
            std::memcpy(out, gbnf.data(), n);
            out[n] = '\0';
        }
        return static_cast<int64_t>(gbnf.size());
    } catch (const std::exception & e) {
        return failed(e.what());
    }
}

int32_t pyllama_shim_abi_version(void) {
    return 5;
}

}

/* dflash27b.h — the C ABI of libdflash27b.
 * Test and tool entry points (single ops, kernels, hooks, timing) are in dflash27b_dev.h.
 *
 * Opaque handles, integer status codes (0 = ok, -1 = error) and a
 * thread-local last-error string.  No call prints, exits or aborts on bad
 * input; every failure is a status plus dfl_last_error().  The Python package
 * mirrors this header in its cffi cdef (python/dflash27b/_lib.py): keep the
 * two in step.
 */
#ifndef DFLASH27B_H
#define DFLASH27B_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DFL_OK 0
#define DFL_ERROR (-1)

/* ggml type ids (GGUF tensor types) the engine understands */
#define DFL_TYPE_F32 0
#define DFL_TYPE_F16 1
#define DFL_TYPE_Q4_0 2
#define DFL_TYPE_Q8_0 8
#define DFL_TYPE_Q4_K 12
#define DFL_TYPE_Q5_K 13
#define DFL_TYPE_Q6_K 14
#define DFL_TYPE_BF16 30

typedef struct dfl_model dfl_model;
typedef struct dfl_context dfl_context;

const char* dfl_version(void);
/* e.g. "cpu: avx2; cuda: not built" or "cpu: avx2+avx512; cuda: sm_86,sm_89,sm_90"; the cpu part
 * names the kernels in use now ("avx2+avx512": the AVX-512 kernels for batches of 3+ tokens). */
const char* dfl_build_info(void);
/* The CPU's AVX-512 batch kernels (same bits as the AVX2 ones) for the process from now on:
 * 1 on (an error where the CPU or build lacks them), 0 off, -1 as DFLASH27B_CPU_AVX512 says
 * (on where supported unless it is "0"). */
int dfl_cpu_avx512(int32_t mode);
const char* dfl_last_error(void);
const char* dfl_type_name(uint32_t type); /* NULL if unknown */

typedef struct {
  int32_t n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, n_rot, n_vocab, n_ctx_train;
  int32_t ssm_conv_kernel, ssm_dk, ssm_nk, ssm_nv, ssm_dv, tied_embeddings;
  float rope_base, rms_eps;
  uint64_t weight_bytes, file_bytes;
  int32_t n_mtp_layers;  /* the file's MTP head layers the engine drafts with (0 or 1; qwen35.nextn_predict_layers) */
  uint64_t mtp_bytes;    /* its own tensors' bytes */
} dfl_model_info;

dfl_model* dfl_model_load(const char* path);
void dfl_model_free(dfl_model* m);
int dfl_model_get_info(const dfl_model* m, dfl_model_info* out);
int dfl_model_layer_is_recurrent(const dfl_model* m, int32_t layer);
int32_t dfl_model_tensor_count(const dfl_model* m);
/* name valid while the model lives */
int dfl_model_tensor_info(const dfl_model* m, int32_t i, const char** name, uint32_t* type, int64_t ne[4]);
/* Every metadata key of a GGUF file as one JSON object {key: value} (arrays as JSON arrays; NaN and infinities
 * as Python's json writes them; bytes that are not UTF-8 as U+FFFD), read by the validating reader the
 * model loader uses.  Returns a string to release with dfl_string_free, or NULL (dfl_last_error says why). */
char* dfl_gguf_metadata_json(const char* path);
void dfl_string_free(char* s);

typedef struct {
  int32_t n_ctx;
  int32_t n_batch;   /* tokens per internal chunk and largest verify batch */
  int32_t n_threads; /* 0 = all cores */
  uint32_t kv_type;  /* DFL_TYPE_F32 / F16 / Q8_0 / Q4_0 */
  int32_t device;    /* DFL_DEVICE_CPU or DFL_DEVICE_CUDA (the first GPU; an error if none) */
  uint32_t state_type; /* delta-net recurrent state: DFL_TYPE_F32 (default), BF16 or F16, rounded after
                          every token alike in chains and trees, so each choice is exact on its own terms */
} dfl_context_params;

#define DFL_DEVICE_CPU 0
#define DFL_DEVICE_CUDA 1

/* Bytes a context with these parameters needs on its device, by part; the
 * CUDA backend checks the total against the GPU's free memory before it
 * uploads anything.  max_nodes: the largest verify batch (tree state). */
typedef struct {
  uint64_t weights, kv, recurrent, tree_state, workspace, total;
} dfl_memory_plan;
int dfl_context_memory_plan(const dfl_model* m, const dfl_context_params* p, int32_t max_nodes, dfl_memory_plan* out);

dfl_context_params dfl_context_default_params(void);
dfl_context* dfl_context_new(dfl_model* m, const dfl_context_params* p);
void dfl_context_free(dfl_context* c);
/* A slot: a new context (its own sequence: KV cache, delta-net state, drafters) on base's model and backend
 * (the weights uploaded once, one thread pool), so that dfl_generate_next_many decodes several requests in
 * one batched forward.  p as for dfl_context_new (device ignored: base's); NULL = base's parameters.  The
 * model must outlive it; base need not. */
dfl_context* dfl_context_new_slot(dfl_context* base, const dfl_context_params* p);
/* e.g. "cpu (avx2)" or "cuda (NVIDIA H100 80GB HBM3)"; valid while the context lives */
const char* dfl_context_backend(const dfl_context* c);
int dfl_context_reset(dfl_context* c);
int32_t dfl_context_n_past(const dfl_context* c);

/* The one forward.  n tokens with absolute positions and parent indices
 * (parent == NULL means a chain: parent[i] = i-1).  Logits of the rows in
 * logit_rows go to logits[n_logits][n_vocab]; the residual stream after each
 * layer in capture_layers goes to hidden[n][n_capture][n_embd].
 * commit != 0: the chain is appended to the committed state.
 * commit == 0: the batch (any tree) is verified; dfl_commit_path then keeps a
 * root-to-node path of it. */
int dfl_forward(dfl_context* c, int32_t n, const int32_t* tokens, const int32_t* pos, const int32_t* parent,
                int32_t n_logits, const int32_t* logit_rows, float* logits, int32_t n_capture,
                const int32_t* capture_layers, float* hidden, int32_t commit);
int dfl_commit_path(dfl_context* c, const int32_t* nodes, int32_t n);

/* The committed state as bytes (per layer: KV rows [0, n_past) of attention
 * layers, conv window + recurrent state of delta-net layers).  Two contexts
 * that committed the same tokens hold equal bytes. */
int64_t dfl_context_state_size(const dfl_context* c);
int dfl_context_get_state(const dfl_context* c, void* dst, int64_t size);
/* Prefix reuse (what a prompt cache stores and restores): the KV rows of
 * positions [p0, p1) of every attention layer (layer by layer: K rows, then V
 * rows), and every delta-net layer's conv window + recurrent state.  Restoring
 * rows [0, n) and the recurrent state a context had at n_past == n, then
 * dfl_context_set_n_past(n), continues exactly as that context would. */
int64_t dfl_context_kv_bytes_per_position(const dfl_context* c);
int dfl_context_get_kv(const dfl_context* c, int32_t p0, int32_t p1, void* dst, int64_t size);
int dfl_context_set_kv(dfl_context* c, int32_t p0, int32_t p1, const void* src, int64_t size);
int64_t dfl_context_recurrent_bytes(const dfl_context* c);
int dfl_context_get_recurrent(const dfl_context* c, void* dst, int64_t size);
int dfl_context_set_recurrent(dfl_context* c, const void* src, int64_t size);
int dfl_context_set_n_past(dfl_context* c, int32_t n);
/* Target forwards run by this context so far. */
int64_t dfl_context_n_forwards(const dfl_context* c);

/* ---- generation (pull style: begin, then next until it returns 0) ----
 * The first next() returns the prefill's token; every later call runs one
 * step (AR: one target forward; chain: one draft forward, one target forward
 * verifying [root, drafts], a commit by gather) and returns the tokens it
 * committed. */
#define DFL_MODE_AR 0
#define DFL_MODE_CHAIN 1
#define DFL_MODE_DDTREE 2
#define DFL_MODE_AUTO 3  /* each step AR or a DDTree of the budget that maximises expected tokens/s (up to tree_budget) */

typedef struct {
  int32_t max_new_tokens;
  int32_t ignore_eos;
  int32_t n_eos;
  const int32_t* eos_ids;
  int32_t mode;        /* DFL_MODE_AR / CHAIN / DDTREE (the last two need an attached drafter or hook) */
  int32_t block_size;  /* chain/ddtree: draft block incl. the root; 0 = the drafter's block_size */
  int32_t tree_budget; /* ddtree: draft nodes per step (default 22); auto: the largest it may choose */
  int32_t tree_topk;   /* ddtree: candidates per depth; 0 = the budget */
  int32_t chain_seed;  /* ddtree: insert the drafter's greedy chain first (default 1) */
  /* sampling (llama.cpp order: top-k, typical-p, top-p, min-p, temperature); temperature 0 = greedy */
  float temperature;   /* >= 0 */
  int32_t top_k;       /* 0 = off */
  float top_p;         /* (0, 1]; 1 = off */
  float min_p;         /* [0, 1]; 0 = off */
  uint64_t seed;       /* the token at position p is drawn with a number that depends only on (seed, p) */
  /* repetition penalties (llama.cpp's, applied before the sampler, in every mode: a verified node counts its
     own ancestors' tokens, so speculative output stays AR's): repeat (1 = off), frequency and presence
     (0 = off) over the last repeat_last_n tokens of the sequence, prompt included (-1 = all, 0 = off) */
  float repeat_penalty;
  float frequency_penalty;
  float presence_penalty;
  int32_t repeat_last_n;
  int32_t n_logprobs;  /* -1 (default): off; k in 0..20: each emitted token's log-probability (log-softmax of
                          the target's raw logits) and the k most likely alternatives, in every mode */
  int32_t tree_expand; /* ddtree/auto with a draft model: 0 (default) = the tree from one draft pass (its greedy
                          path with per-depth alternatives); w > 0 = expanding branches, each depth running the w
                          most probable nodes of the one before (tree_topk children each) */
  float typical_p;     /* locally typical sampling, after top-k (llama.cpp's typ_p): (0, 1]; 1 = off */
  int32_t tree_scores; /* ddtree/auto with a DFlash2 drafter: 0 (default) = the tree from its candidate selector's
                          transition scores; 1 = from the draft probabilities alone, as a DFlash drafter's */
  /* a logit bias (OpenAI's logit_bias, llama.cpp's --logit-bias): logit_bias_values[i] is added to the logit of
     token logit_bias_ids[i] before the penalties and the sampler, in every mode (each id once, in the vocabulary;
     log-probabilities stay the raw logits'); 0 entries (default) = none */
  int32_t n_logit_bias;
  const int32_t* logit_bias_ids;
  const float* logit_bias_values;
} dfl_gen_params;

dfl_gen_params dfl_gen_default_params(void);

typedef struct {
  int32_t prompt_tokens;
  int32_t generated_tokens;
  int32_t steps;           /* target forwards after prefill */
  int32_t stop_reason;     /* 0 running, 1 length, 2 eos, 3 context full */
  double prefill_s;
  double decode_s;
} dfl_gen_stats;

int dfl_generate_begin(dfl_context* c, const int32_t* prompt, int32_t n_prompt, const dfl_gen_params* p);
/* As dfl_generate_begin, keeping the first n_keep prompt tokens' state that
 * the context already holds (restored, n_past == n_keep < n_prompt): only
 * the rest is prefilled, and the decode equals a cold one token for token. */
int dfl_generate_begin_keep(dfl_context* c, const int32_t* prompt, int32_t n_prompt, int32_t n_keep,
                            const dfl_gen_params* p);
/* Writes up to cap new tokens; returns how many (0 = finished), -1 on error. */
int32_t dfl_generate_next(dfl_context* c, int32_t* out_tokens, int32_t cap);
/* One step of each of n slots (contexts sharing a backend: dfl_context_new_slot), each begun with
 * dfl_generate_begin: their drafts are made one by one, their verify batches run as one forward (the
 * row-wise work once for all, at most the first slot's batch size in all), then each accepts and commits on
 * its own.  Slot k's tokens go to out_tokens[k * cap ..], their count to counts[k] (0 once it is done).  Each
 * slot decides exactly the tokens its own dfl_generate_next would.  Returns the tokens in all (0: every slot
 * is done), -1 on error. */
int32_t dfl_generate_next_many(dfl_context* const* cs, int32_t n, int32_t* out_tokens, int32_t cap, int32_t* counts);
int dfl_generate_stats(const dfl_context* c, dfl_gen_stats* out);

typedef struct {
  int32_t committed;       /* tokens the step added to the output, bonus included (1..block) */
  int32_t drafted;         /* draft nodes verified (chain: block-1; ddtree: tree size) */
  int32_t accepted;        /* drafts on the accepted path */
  int32_t tree_depth;      /* deepest draft node */
  int32_t target_forwards; /* target forwards the step ran (1) */
  double draft_s, tree_s, verify_s, commit_s;
  int32_t auto_budget;     /* auto: draft nodes verified (0 = an AR step); -1 in the other modes */
  int32_t probe;           /* auto: 1 when the step was a forced exploration */
  double expected_tokens;  /* auto: the tokens the choice expected (bonus included) */
  double est_tok_s;        /* auto: its expected tokens per second */
  double est_ar_tok_s;     /* auto: the expected tokens per second of an AR step */
  int32_t pruned;          /* draft nodes a constraint forbade, dropped before the verify */
  double mask_s;           /* a constraint's masks for the step (before the verify) */
  int32_t drafter;         /* auto: the portfolio's drafter that drafted (dfl_context_drafter_name; -1: none) */
  int32_t declined_learnt; /* auto: trees drafted and declined earlier (AR won their step) whose tokens this step
                              decided: their drafters' acceptance learnt from them */
  int32_t draft_batch;     /* slots (dfl_generate_next_many): the blocks its drafter forward made at once, this
                              slot's among them (0: a forward of its own, or none) */
  int32_t draft_depth;     /* the depths asked of the drafter below the root (0: no draft); in auto mode an
                              autoregressive drafter's (the MTP head, a draft model) fit the tree it expects */
  int32_t merged;          /* auto: verified nodes a free drafter (prompt lookup) added to the tree of the drafter
                              that drafted (their union verified in one forward) */
} dfl_step_stats;

/* Log-probabilities of the emitted tokens (dfl_gen_params.n_logprobs >= 0): one entry per token, in order. */
typedef struct {
  int32_t token;
  float logprob;
  int32_t n_top;
  int32_t top_ids[20];
  float top_logprobs[20];
} dfl_token_logprob;
int32_t dfl_generate_n_logprobs(const dfl_context* c);
int dfl_generate_logprob(const dfl_context* c, int32_t i, dfl_token_logprob* out);

int32_t dfl_generate_n_steps(const dfl_context* c);
/* Auto mode's portfolio: the attached drafters that rank, most preferred first ("dflash", "draft model",
 * "lookup", a test hook); NULL past the last.  Each step drafts with the one expected to be fastest. */
const char* dfl_context_drafter_name(const dfl_context* c, int32_t i);
int dfl_generate_step_stats(const dfl_context* c, int32_t i, dfl_step_stats* out);

/* Number of CUDA devices usable by this build (0: none, no driver, or not built). */
int dfl_cuda_device_count(void);

/* ==================== DFlash drafter (z-lab layout) ====================
 * path: a directory holding config.json + model.safetensors, or the
 * .safetensors file with config.json beside it.  Every tensor is checked
 * against the shapes config.json implies.  target: the model the drafter will
 * serve; when not NULL the pair is validated (hidden size, target_layer_ids
 * inside the target's layers, vocab size, mask token) and a mismatch fails
 * with a message naming it.  NULL skips the pair checks.  The drafter does not
 * keep a reference to target. */
typedef struct dfl_draft dfl_draft;

typedef struct {
  int32_t n_layer, hidden, n_head, n_head_kv, head_dim, n_ff, n_vocab;
  int32_t block_size, mask_token_id;
  int32_t n_target_layers;       /* entries used in target_layer_ids (at most 16) */
  int32_t target_layer_ids[16];  /* 0-based target layers whose outputs feed fc */
  int32_t n_sliding_layers;      /* sliding_attention layers (causal, windowed) */
  int32_t sliding_window;        /* 0: none */
  int32_t num_target_layers;     /* the config's num_target_layers (0: absent) */
  float rms_eps, rope_theta;
  char rope_type[16];            /* "default", "linear" or "yarn" */
  float rope_factor;             /* 1 when unscaled */
  float rope_attention_factor;   /* yarn's cos/sin scaling; 1 otherwise */
  uint64_t weight_bytes;         /* bytes of all tensors in model.safetensors (0 from dfl_draft_config_info) */
  int32_t generation;            /* 1: DFlashDraftModel, 2: DFlash2DraftModel (loads; cannot draft yet) */
  int32_t conv_kernel_size, conv_group_size, selector_top_k, selector_rank;  /* DFlash2; 0 otherwise */
} dfl_draft_info;

dfl_draft* dfl_draft_load(const char* path, const dfl_model* target);
/* As dfl_draft_load, with the matrices converted at load to weight_type:
 * DFL_TYPE_BF16 or DFL_TYPE_Q8_0 (DFL_DRAFT_AS_STORED keeps the file's). */
#define DFL_DRAFT_AS_STORED 0xFFFFFFFFu
dfl_draft* dfl_draft_load_as(const char* path, const dfl_model* target, uint32_t weight_type);
void dfl_draft_free(dfl_draft* d);
int dfl_draft_get_info(const dfl_draft* d, dfl_draft_info* out);
/* Reads and validates a drafter's config.json alone (path: the file or its
 * directory) with the same reader dfl_draft_load uses; no weights are opened.
 * For listings and memory plans. */
int dfl_draft_config_info(const char* path, dfl_draft_info* out);

/* The drafter at run time: a feature ring of ring_capacity positions and a
 * draft KV cache of the same capacity (memory constant in context length). */
typedef struct {
  int32_t ring_capacity; /* default 4096 */
  int32_t n_threads;     /* standalone drafters only; 0 = all cores */
} dfl_drafter_params;

dfl_drafter_params dfl_drafter_default_params(void);

/* Several drafters may be attached at once (a DFlash drafter, a draft model, the MTP head, prompt lookup;
 * one of each): the order they were attached in is the order of preference — chain and DDTree steps draft
 * with the first that can, auto mode picks among them each step (dfl_context_drafter_name).  Reattaching one
 * moves it last.
 *
 * Attaches drafter d (which must outlive the context's use of it) to c for
 * chain decoding, on c's threads; d == NULL detaches.  The pair is validated. */
int dfl_context_attach_draft(dfl_context* c, const dfl_draft* d, const dfl_drafter_params* p);
/* Classic draft-model speculation: m (a qwen35 model with the target's vocabulary, which must outlive the
 * context's use of it) drafts chain / DDTree / auto steps from its own context (KV cache and delta-net
 * state, same device and KV type), rolled back to the accepted path from per-position snapshots.  The
 * vocabulary size is checked here; m == NULL detaches. */
int dfl_context_attach_draft_model(dfl_context* c, const dfl_model* m);
/* Prompt lookup as the drafter: each step drafts what followed the context's last n-gram (ngram_max down to
 * ngram_min tokens) where it occurred before, as a chain or a tree of the continuations (no weights, no
 * forward); block = draft tokens per step incl. the root when a request sets none.  block <= 0 detaches. */
int dfl_context_attach_lookup(dfl_context* c, int32_t ngram_min, int32_t ngram_max, int32_t block);
/* The target's own MTP head as a drafter (the file must carry one: dfl_model_info.n_mtp_layers > 0): it drafts
 * `block` - 1 tokens a step autoregressively, each depth's top-K ranking chain and DDTree; block <= 0 detaches.
 * It reads the trunk's last hidden state of every committed position and keeps one layer of KV. */
int dfl_context_attach_mtp(dfl_context* c, int32_t block);
/* Bytes held by the attached drafters: a DFlash drafter's ring and KV cache, a draft model's context, the MTP
 * head's rows (0 when none). */
int64_t dfl_context_draft_state_bytes(const dfl_context* c);

/* Prefill progress: fn(user, done, total) after each n_batch chunk of the
   prompt; a nonzero return abandons the prefill (the call fails with
   "prefill cancelled").  NULL removes it. */
typedef int32_t (*dfl_progress_fn)(void* user, int32_t done, int32_t total);
int dfl_context_set_prefill_progress(dfl_context* c, dfl_progress_fn fn, void* user);

/* Structured output: the caller's matcher (a JSON schema or grammar) decides which tokens may come next, and
   every mode's reply is the constrained AR reply.  masks(user, n, tokens, parents, keep, masks): for the n
   nodes of a step (node 0 = the last decided token, already committed; node i > 0 the path of its ancestors'
   tokens after node 0 and its own, parents[i] < i) set bit t of masks[i * words + t / 32], words =
   (n_vocab + 31) / 32, when token t may follow node i (a node its parent's mask forbids is never reached; its
   mask may be left as is).  With prune on, only the first `keep` nodes i > 0 whose parent is one of them (or
   node 0) and whose parent's mask allows them are kept: masks after the keep-th are never read (a callback
   may stop there).  With prune off every node is kept and n <= keep + 1.  commit(user, n, tokens): the tokens just decided, in order (the prefill's first, then each step's
   accepted drafts and bonus).  Either returning nonzero fails the call in progress.  prune: drop draft nodes
   the constraint forbids before the verify.  masks == NULL removes the constraint.  The masks are asked once
   per step before the target's verify; the logits rows of every verified node then come back to the host. */
typedef int32_t (*dfl_constraint_masks_fn)(void* user, int32_t n, const int32_t* tokens, const int32_t* parents,
                                           int32_t keep, uint32_t* masks);
typedef int32_t (*dfl_constraint_commit_fn)(void* user, int32_t n, const int32_t* tokens);
/* forced (may be NULL): writes up to cap tokens the constraint forces after the decided ones (each the only one
   it allows there), returns how many (or -1): they are drafted first, as drafts that cannot miss. */
typedef int32_t (*dfl_constraint_forced_fn)(void* user, int32_t cap, int32_t* tokens);
int dfl_context_set_constraint(dfl_context* c, dfl_constraint_masks_fn masks, dfl_constraint_commit_fn commit,
                               dfl_constraint_forced_fn forced, void* user, int32_t prune);

#ifdef __cplusplus
}
#endif
#endif

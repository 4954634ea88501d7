/* dflash27b_dev.h — libdflash27b's entry points for tests, tools and benchmarks: single ops and kernels
 * with their references, the draft hooks, a standalone drafter, CUDA timing and profiling switches.  Not a
 * stable interface: they change with the engine.  Include after dflash27b.h. */
#ifndef DFLASH27B_DEV_H
#define DFLASH27B_DEV_H
#include "dflash27b.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The auto-mode chooser alone (tests): the budget in [min_budget, n] that
 * maximises expected tokens/s for a drafted tree whose nodes, in the DDTree
 * builder's order, have these depths and path log-probabilities, given costs
 * in seconds (verify time by node count, root included) and a calibration
 * per depth (index = depth; missing = 1).  with_draft prices the draft in.
 * max_worst_s: the most a budget's worst case (its whole cost for one token, less an AR step) may lose, as
 * the request's loss allowance bounds a bet (HUGE_VAL: no bound); no budget within it: AR. */
typedef struct {
  double ar_s, draft_s, tree_s, commit_s;
  int32_t n_verify;
  int32_t verify_nodes[64];
  double verify_s[64];
  int32_t n_calib;
  double depth_calib[64];
  /* draft_s is the drafter forward of the block being priced; these are the times learnt by block rows
   * (root included), which draft_s is interpolated from for a block's rows */
  int32_t n_draft;
  int32_t draft_rows[64];
  double draft_rows_s[64];
  /* structured output: the host time of an AR step's masks and of this drafter's tree's (every drafted node),
   * learnt on constrained steps and priced while the request has a constraint (constrained != 0) */
  double mask_ar_s, mask_tree_s;
  int32_t constrained;
} dfl_auto_estimates;
typedef struct {
  int32_t budget;          /* 0 = AR */
  double expected_tokens;
  double tok_s, ar_tok_s;
  int32_t depth;           /* the deepest node of the budget (0 = AR): auto drafts an autoregressive drafter
                              one depth deeper than this, no more */
} dfl_auto_choice;
int dfl_auto_choose(const dfl_auto_estimates* e, const int32_t* depth, const float* logp, int32_t n,
                    int32_t min_budget, int32_t with_draft, double max_worst_s, dfl_auto_choice* out);
/* The worst case of a drafter's smallest step against an AR step (seconds), for `slots` requests sharing the
 * step: what a request's loss allowance must cover before auto mode drafts (spec/adaptive.h worst_loss_s). */
int dfl_auto_worst_loss(const dfl_auto_estimates* e, int32_t slots, double* out_s);
/* Rows of Q6_K weights the CPU kernels have read from their pre-transposed panels so far in this process
 * (quant.h with_cpu_layout): 0 where they do not run (AVX-512 active, the portable build,
 * DFLASH27B_CPU_Q6K_PANELS=0). */
int64_t dfl_cpu_q6k_panel_rows(void);
/* A request's loss allowance (spec/adaptive.h LossAllowance) after the drafted steps given, at AR steps of
 * ar_s seconds: what one bet may still lose in its worst case (bet_s) and what a probe may (probe_s). */
typedef struct {
  int32_t probe;      /* 1: a probe (exploring: charged to the probes' share) */
  int32_t budget;     /* draft nodes verified (0: AR won the step, its draft alone was spent) */
  int32_t committed;  /* tokens the step gave */
  double draft_s, tree_s, verify_s, commit_s;
  double expected_s;  /* what the step was expected to cost (0: unknown): it counts at most twice that */
} dfl_auto_step;
int dfl_auto_allowance(int32_t max_new_tokens, double ar_s, const dfl_auto_step* steps, int32_t n, double* bet_s,
                       double* probe_s);
/* What a context's auto mode has learnt so far for drafter i of its portfolio (0 = the most preferred): the
 * same tables (verify sizes timed, per-depth calibration).  DFL_ERROR for a drafter it does not hold. */
int dfl_context_auto_estimates(const dfl_context* c, int32_t drafter, dfl_auto_estimates* out);
/* Auto mode's verify costs measured now (the Decoder's warm-up, after a generate): forwards of 2, 4, 8 ...
 * max_nodes nodes after the committed text, never committed, each size's time given to every drafter. */
int dfl_context_measure_verify(dfl_context* c, int32_t max_nodes);

/* ---- op entry points for tests and tools ---- */
/* The sampler alone: the token for absolute position pos drawn from logits. */
int32_t dfl_sample(const float* logits, int32_t n_vocab, float temperature, int32_t top_k, float top_p, float min_p,
                   uint64_t seed, int64_t pos);
/* DDTree construction from draft logits [L][n_vocab] (depths 1..L): writes up
 * to cap nodes in topological order (node i+1 = tokens[i] at depth[i], parent
 * parents[i], 0 = the root) and returns how many, -1 on error. */
int32_t dfl_build_ddtree(const float* logits, int32_t L, int32_t n_vocab, int32_t budget, int32_t topk,
                         int32_t chain_seed, int32_t cap, int32_t* tokens, int32_t* depth, int32_t* parents);
/* The tree from a selector lattice (dfl_drafter_propose_lattice's arrays, L depths, K candidates); logp (when not
 * NULL) gets each node's cumulative log-probability.  Returns the node count or -1. */
int32_t dfl_build_ddtree_lattice(const int32_t* cand_ids, const float* cand_logp, const float* edge, int32_t L,
                                 int32_t K, int32_t budget, int32_t chain_seed, int32_t cap, int32_t* tokens,
                                 int32_t* depth, int32_t* parents, float* logp);
/* The union of two draft trees under one root (auto mode's merge of a free drafter's tree into the chosen
 * drafter's: spec/tree_merge.h).  Tree x has nx nodes (x_tokens, x_parents: 0 = the root, parent < index) and
 * each node's acceptance x_q in [0, 1].  Writes up to cap nodes best-first, parents first (tokens, depth,
 * parents, q) and for each its 1-based index in a and in b (0: not there); returns the count, -1 on error. */
int32_t dfl_merge_trees(int32_t na, const int32_t* a_tokens, const int32_t* a_parents, const double* a_q, int32_t nb,
                        const int32_t* b_tokens, const int32_t* b_parents, const double* b_q, int32_t cap,
                        int32_t* tokens, int32_t* depth, int32_t* parents, double* q, int32_t* from_a,
                        int32_t* from_b);
/* Runs `iters` parallel loops of varied shapes on one pool of n_threads and
 * checks every index is visited exactly once per loop; -1 with a message if not. */
int dfl_selftest_threadpool(int32_t n_threads, int64_t iters);
/* The MTP head's logits over a sequence (tests against a reference): the trunk runs tokens[0, n) from a fresh
 * state, then the head reads row p = (tokens[p], the trunk's last hidden state at p - 1; zeros for p = 0) at
 * positions 0 .. n-1 of its KV.  logits: [n][n_vocab].  The context is left reset. */
int dfl_dev_mtp_logits(dfl_context* c, const int32_t* tokens, int32_t n, float* logits);
/* Streams `bytes` of memory with n_threads threads; returns GB/s read (best of 3). */
double dfl_measure_read_bandwidth(int64_t bytes, int32_t n_threads);
int dfl_dequantize(uint32_t type, const void* src, int64_t n, float* dst);
int dfl_quantize(uint32_t type, const float* src, int64_t n, void* dst); /* F32/F16/BF16/Q8_0/Q4_0 */
/* y[t][r] = W[r] . x[t] for a rows x cols weight of `type` (row-major blocks).  A Q6_K weight whose rows come
 * in fours is read as a model's is on the CPU, from panels pre-transposed for the call (the repack is part of
 * its time). */
int dfl_matmul(uint32_t type, const void* w, int64_t rows, int64_t cols, const float* x, int32_t n, float* y,
               int32_t n_threads);
/* K-quants, Q8_0 and Q4_0: the arithmetic dfl_matmul's kernels (and the CUDA
 * backend's) must reproduce bit for bit, computed one output at a time (tests) */
int dfl_matmul_reference(uint32_t type, const void* w, int64_t rows, int64_t cols, const float* x, int32_t n,
                         float* y);

/* ==================== CUDA op entry points (tests and tools) ====================
 * Present in every build.  When the library was built without the CUDA
 * backend (dfl_build_info() says "cuda: not built"), dfl_cuda_device_count()
 * returns 0 and the others fail with "CUDA backend not built".  Without a
 * driver or GPU they fail with "no usable CUDA device: ...". */
/* dfl_matmul on the GPU (device 0), host pointers: uploads w and x, runs,
 * downloads y.  Activations stay f32 (no int8 quantisation, unlike the CPU). */
int dfl_cuda_matmul(uint32_t type, const void* w, int64_t rows, int64_t cols, const float* x, int32_t n, float* y);
/* The batch-invariant matmul the CUDA forward uses, host pointers: a token's row of
 * y is the same bits for every n.  Q4_K/Q5_K/Q6_K/Q8_0/Q4_0 (dp4a for up to 8
 * tokens, int8 tensor cores above): activations quantised as the CPU quantises
 * them, the CPU's integer sums and float steps, so y is bit-identical to
 * dfl_matmul's on every CPU build; F16/BF16: tf32 tensor
 * cores with x split into two tf32 parts, within f32 rounding of dfl_matmul. */
int dfl_cuda_matmul_exact(uint32_t type, const void* w, int64_t rows, int64_t cols, const float* x, int32_t n,
                          float* y);
/* Milliseconds per call of the CUDA matmul on random device-resident weights
 * and activations (CUDA events, no host transfers timed); -1 on error.
 * exact != 0: the batch-invariant kernels of dfl_cuda_matmul_exact, which the
 * forward uses (activation quantisation included); 0: the float kernels. */
double dfl_cuda_bench_matmul(uint32_t type, int64_t rows, int64_t cols, int32_t n, int32_t iters, int32_t exact);
/* Device-to-device copy bandwidth of a `bytes` buffer, GB/s counting bytes
 * read + written (the bandwidth floor the GPU record compares with); -1 on error. */
double dfl_cuda_bench_copy(int64_t bytes, int32_t iters);
/* The library's device memory: bytes it holds now and the peak since the last
 * reset (every cudaMalloc it makes: weights, KV, states, workspace, plans),
 * and the device's free / total memory as the driver reports them. */
typedef struct {
  uint64_t allocated, peak, device_free, device_total;
} dfl_cuda_memory;
int dfl_cuda_memory_stats(dfl_cuda_memory* out, int32_t reset_peak);
/* Per-op GPU time of every CUDA context in the process.  on != 0 clears the
 * table and starts recording (two events on the stream around each backend op,
 * read at the context's next host sync); 0 stops.  Off, it costs nothing. */
int dfl_cuda_profile(int32_t on);
/* The table as JSON: {"ops": [{"op": name, "calls": N, "ms": total, "bytes": B}, ...]},
 * slowest first; a matmul's name carries its format, shape and token count,
 * B is what the op must read at least (a matmul's weights, a copy's bytes).
 * *len gets the length without the NUL; fails when cap <= *len. */
int dfl_cuda_profile_report(char* buf, int64_t cap, int64_t* len);
/* What graph mode did in every CUDA context of the process (DFLASH27B_CUDA_GRAPHS,
 * on by default; off while the profile is on): a context records its ops' launches
 * and issues them in segments, replaying a segment as a CUDA graph once the same
 * bytes (kernels, shapes, arguments) have been seen before.  direct_ops: launches,
 * copies and fills issued one by one; replayed_ops: issued inside graphs;
 * graph_launches; captures: graphs built.  reset != 0 zeroes the counts after reading. */
typedef struct {
  int64_t direct_ops, replayed_ops, graph_launches, captures;
} dfl_cuda_graphs;
int dfl_cuda_graph_stats(dfl_cuda_graphs* out, int32_t reset);
/* Graph mode for every CUDA context of the process from now on: 1 on, 0 off, -1 back to what
 * DFLASH27B_CUDA_GRAPHS said when each was created (so one run can time a step both ways). */
int dfl_cuda_graph_mode(int32_t mode);
/* Attention's CTA grouping for every CUDA context from now on: toks tokens x heads query heads of one
 * KV head per CTA (each clipped to what the shape and shared memory allow), or 0, 0 for the automatic
 * choice (the default).  Speed only, to compare: a query row's arithmetic is the same whatever the
 * grouping, so results do not change. */
int dfl_cuda_attention_rows(int32_t toks, int32_t heads);
/* Attention's kernel for every CUDA context from now on: 1 the tensor-core kernel (tf32 mma) where the
 * head allows it (head_dim <= 256), -1 the f32 kernel everywhere, 0 as
 * DFLASH27B_CUDA_ATTN said when each context was created (mma, the default, or simt).  Not speed only: the kernels round differently
 * (each within tolerance of the CPU), so compare modes and runs under one choice. */
int dfl_cuda_attention_kernel(int32_t kind);

/* Pin the rows a K-quant matvec CTA takes (AR steps and verifies of up to 8 tokens; verifies of up to 64
 * on weights of fewer than 2048 rows, 8 tokens a pass): 16 (a group of 8 lanes walks a whole row), 8, 4,
 * 2 or 1 (the CTA's groups split the row's super-blocks), or 0 for the automatic choice by the weight's
 * shape (the default); -1: the automatic choice, and every verify of more than 8 tokens on the tensor
 * cores.  Speed only, to compare: every choice gives the same bits. */
int dfl_cuda_matvec_rows(int32_t rows_per_cta);

/* Pin the K-quant tensor-core kernels (verifies of 9..64 tokens on weights of 2048 rows or more, and
 * prefill chunks): the streaming kernel with 1, 2 or 4 warps splitting each 16 rows' K, 0 for the automatic
 * choice (the default: the streaming kernel split by the weight's shape up to 64 tokens, the tiled kernel
 * for more), -1 for the round-synchronous kernel (what the first GPU record timed) or -2 for the tiled
 * kernel; a pin takes every verify and prefill chunk to its kernel.  Speed only, to compare: every choice
 * gives the same bits. */
int dfl_cuda_mma_split(int32_t warps);

/* Test hook: when set, chain steps take their drafts from fn instead of the
 * drafter: fn writes n tokens for the block whose root token sits at
 * root_pos and returns 0 (nonzero aborts the step with an error). */
typedef int32_t (*dfl_draft_hook)(void* user, int32_t root_pos, int32_t root_token, int32_t n, int32_t* tokens);
int dfl_context_set_draft_hook(dfl_context* c, dfl_draft_hook fn, void* user);
/* Test hook for ddtree steps: fn writes up to cap nodes (tokens[i], parents[i]
 * for node i+1; parent 0 is the root, a node's parent precedes it) and returns
 * how many (0..cap), or -1 to abort the step with an error. */
typedef int32_t (*dfl_tree_hook)(void* user, int32_t root_pos, int32_t root_token, int32_t cap, int32_t* tokens,
                                 int32_t* parents);
int dfl_context_set_tree_hook(dfl_context* c, dfl_tree_hook fn, void* user);
/* Test hook for ddtree and auto steps, in place of the drafter's ranked
 * output: fn writes the top-k token ids and log-probs of depths 1..L
 * ([L][k], descending per depth) for the block whose root sits at root_pos,
 * and returns 0 (nonzero aborts the step).  An oracle drafter is one. */
typedef int32_t (*dfl_topk_hook)(void* user, int32_t root_pos, int32_t root_token, int32_t L, int32_t k,
                                 int32_t* ids, float* logp);
int dfl_context_set_topk_hook(dfl_context* c, dfl_topk_hook fn, void* user);

/* A standalone drafter runtime (tests and tools): push the features of
 * committed positions, then propose a block rooted at the next position. */
typedef struct dfl_drafter dfl_drafter;
dfl_drafter* dfl_drafter_new(const dfl_draft* d, const dfl_model* target, const dfl_drafter_params* p);
void dfl_drafter_free(dfl_drafter* r);
int dfl_drafter_reset(dfl_drafter* r);
int32_t dfl_drafter_n_pos(const dfl_drafter* r);
/* features: [n][len(target_layer_ids) * hidden] for positions pos0 .. pos0+n-1 (pos0 = n_pos) */
int dfl_drafter_push_features(dfl_drafter* r, int32_t pos0, int32_t n, const float* features);
/* block_tokens[0] is the root at position n_pos; logits: [n_block-1][n_vocab] */
int dfl_drafter_propose(dfl_drafter* r, int32_t n_block, const int32_t* block_tokens, float* logits);
/* DFlash2: the candidate selector's chain for the block (path: n_block - 1 tokens) and, when not NULL, each
 * position's candidates (cand_ids / cand_logp: [n_block - 1][selector_top_k], log-prob desc, id asc). */
int dfl_drafter_propose_path(dfl_drafter* r, int32_t n_block, const int32_t* block_tokens, int32_t* path,
                             int32_t* cand_ids, float* cand_logp);
/* DFlash2: the selector's lattice (K = selector_top_k): cand_ids / cand_logp [n_block - 1][K] as above and
 * edge [n_block - 1][K][K], edge[t][i][j] the score of candidate j of depth t after candidate i of depth t - 1
 * (the root for t = 0: every row the root's). */
int dfl_drafter_propose_lattice(dfl_drafter* r, int32_t n_block, const int32_t* block_tokens, int32_t* cand_ids,
                                float* cand_logp, float* edge);

#ifdef __cplusplus
}
#endif
#endif

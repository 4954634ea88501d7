// generator.cpp — the decode loop: AR, chain, DDTree and auto steps on Context::forward, drafts from Proposers.
#include "spec/generator.h"
#include "spec/tree_merge.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace dfl {

using Clock = std::chrono::steady_clock;
static double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

Generator::Generator(Context& ctx) : ctx_(ctx) {
  const char* v = std::getenv("DFLASH27B_TREE_MERGE");
  merge_trees_ = !(v && std::strcmp(v, "0") == 0);
}

void Generator::set_proposers(std::vector<Proposer*> ps) {
  std::vector<Proposer*> next;
  for (Proposer* p : ps)
    if (p) next.push_back(p);
  // auto mode's costs and acceptance belong to the drafters it measured: other drafters start afresh
  if (next != proposers_) {
    drafters_.clear();
    for (Proposer* p : next)
      if (p->can(Proposer::Rank)) drafters_.push_back(p);
    autos_.assign(std::max<size_t>(drafters_.size(), 1), AutoController{});
  }
  proposers_ = std::move(next);
  readers_.clear(), reader_offset_.clear(), capture_.clear();
  feature_capacity_ = 0;
  const size_t H = (size_t)ctx_.model().cfg.n_embd;
  for (Proposer* p : proposers_) {
    const std::vector<int32_t>* layers = p->feature_layers();
    if (!layers || layers->empty()) continue;
    // its layers as a run already captured (the MTP head's last layer may end DFlash's list), else appended
    auto at = std::search(capture_.begin(), capture_.end(), layers->begin(), layers->end());
    if (at == capture_.end()) at = capture_.insert(capture_.end(), layers->begin(), layers->end());
    readers_.push_back(p);
    reader_offset_.push_back((size_t)(at - capture_.begin()) * H);
    feature_capacity_ = std::max(feature_capacity_, p->feature_capacity());
  }
}

void Generator::give_features(int32_t pos0, int n, const float* captured, const int32_t* rows,
                              const int32_t* tokens) {
  const size_t stride = capture_.size() * (size_t)ctx_.model().cfg.n_embd;
  for (size_t i = 0; i < readers_.size(); ++i)
    readers_[i]->take_features(pos0, n, captured ? captured + reader_offset_[i] : nullptr, stride, rows, tokens);
}

Proposer* Generator::first(Proposer::Capability c) const {
  for (Proposer* p : proposers_)
    if (p->can(c)) return p;
  return nullptr;
}

int Generator::block_of(int k) const {
  if (p_.block_size > 0) return p_.block_size;
  const int own = k >= 0 ? drafters_[(size_t)k]->default_block() : 0;
  return own > 0 ? own : block_;
}

int Generator::default_block() const {
  for (Proposer* p : proposers_)
    if (p->default_block() > 0) return p->default_block();
  return 0;
}

void Generator::begin(const int32_t* prompt, int n_prompt, const GenParams& p, int n_keep) {
  const Qwen35Config& c = ctx_.model().cfg;
  if (n_prompt <= 0) fail("empty prompt: give at least one token");
  if (n_keep < 0 || n_keep >= n_prompt)
    fail("kept prefix of %d tokens must be shorter than the prompt (%d tokens)", n_keep, n_prompt);
  if (n_keep > 0 && ctx_.n_past() != n_keep)
    fail("kept prefix of %d tokens but the context holds %d", n_keep, ctx_.n_past());
  if (n_prompt >= ctx_.params().n_ctx)
    fail("prompt of %d tokens does not fit the context length %d (leave room for at least one new token)",
         n_prompt, ctx_.params().n_ctx);
  if (p.max_new_tokens < 0) fail("max_new_tokens must be >= 0 (got %d)", p.max_new_tokens);
  validate_sampler(p.sampler, c.n_vocab);
  block_ = 1;
  if (p.mode == DecodeMode::DDTree || p.mode == DecodeMode::Auto) {
    const bool is_auto = p.mode == DecodeMode::Auto;
    // auto prices trees it builds from a ranking; ddtree also takes a proposer that gives whole trees
    if (!first(Proposer::Rank) && (is_auto || !first(Proposer::Tree)))
      fail("%s mode needs a drafter (none is attached)", is_auto ? "auto" : "ddtree");
    if (p.tree.budget < 0) fail("tree budget must be >= 0 (got %d)", p.tree.budget);
    if (p.tree.topk < 0) fail("top-K must be >= 0 (got %d)", p.tree.topk);
    if (p.tree.expand < 0) fail("tree expansion width must be >= 0 (got %d)", p.tree.expand);
    if (p.tree.expand > 0 && !first(Proposer::Expand))
      fail("expanding branches (tree expansion width %d) needs a draft model; 0 drafts the tree from one pass",
           p.tree.expand);
    block_ = p.block_size > 0 ? p.block_size : default_block() > 0 ? default_block() : 1;
    if (p.tree.budget + 1 > ctx_.params().n_batch)
      fail("tree budget %d exceeds the context's batch size %d (minus the root)", p.tree.budget, ctx_.params().n_batch);
  } else if (p.mode == DecodeMode::Chain) {
    if (!first(Proposer::Chain)) fail("chain mode needs a drafter (none is attached)");
    block_ = p.block_size > 0 ? p.block_size : default_block();
    if (block_ < 1) fail("chain mode needs a block size (no drafter to take it from)");
    if (block_ > ctx_.params().n_batch)
      fail("block size %d exceeds the context's batch size %d", block_, ctx_.params().n_batch);
  } else if (p.mode != DecodeMode::AR) {
    fail("unknown decode mode %d", (int)p.mode);
  }
  if (p.n_logprobs < -1 || p.n_logprobs > kMaxLogprobs)
    fail("top log-probabilities: %d asked, 0..%d supported (-1 = off)", p.n_logprobs, kMaxLogprobs);
  p_ = p;
  logprobs_.clear();
  done_ = true;  // until the prefill has succeeded: a failed begin leaves nothing to continue
  stats_ = GenStats{};
  stats_.prompt_tokens = n_prompt;
  steps_.clear();
  if (n_keep == 0) ctx_.reset();
  hist_.assign(prompt, prompt + n_prompt);
  for (Proposer* q : proposers_) q->reset();
  declined_.clear();
  if (p.mode == DecodeMode::Auto)
    for (AutoController& ac : autos_) ac.new_request(), ac.set_constrained(constraint_ != nullptr);
  // the tokens this request can give: a max_new_tokens past the context (an OpenAI request without max_tokens
  // runs to the context's end) would otherwise promise the allowance an AR time no decode reaches
  allowance_.begin(std::min(p.max_new_tokens, ctx_.params().n_ctx - n_prompt));
  if (n_keep > 0 && capturing()) give_features(0, n_keep, nullptr, nullptr, nullptr);  // kept: skipped
  logits_.assign((size_t)c.n_vocab, 0.f);
  auto t0 = Clock::now();
  prefill(prompt, n_prompt, n_keep);
  // a proposer with a context of its own reads the prompt now, with the prefill, not inside the first step's
  // draft time (what auto mode prices drafting by)
  if (p.mode != DecodeMode::AR)
    for (Proposer* q : proposers_) q->prompt_done(prompt, n_prompt);
  stats_.prefill_s = since(t0);
  first_emitted_ = false;
  done_ = false;
  if (p.max_new_tokens == 0) {
    done_ = true;
    stats_.stop = StopReason::Length;
    logprobs_.clear();
  }
}

void Generator::prefill(const int32_t* prompt, int n, int first) {
  const int chunk = ctx_.params().n_batch;
  const bool cap = capturing();
  // Only the newest `capacity` positions can reach a reader: capture those.
  const int first_captured = cap ? std::max(0, n - feature_capacity_) : n;
  for (int off = first; off < n; off += chunk) {
    const int m = std::min(chunk, n - off);
    pos_.resize(m);
    for (int i = 0; i < m; ++i) pos_[i] = off + i;
    Batch b{m, prompt + off, pos_.data(), nullptr};
    ForwardOutputs o;
    int32_t last = m - 1;
    if (off + m == n) {
      o.n_logits = 1;
      o.logit_rows = &last;
      if (!need_rows()) {
        top_ids_.resize(row_k()), top_logp_.resize(row_k());
        o.topk = row_k(), o.top_ids = top_ids_.data(), o.top_logp = logp_rows();
      } else {
        o.logits = logits_.data();
      }
    }
    const bool grab = cap && off + m > first_captured;
    if (grab) {  // the captured rows stay on the backend the drafter shares
      o.n_capture = (int)capture_.size();
      o.capture_layers = capture_.data();
      o.hidden_on_backend = true;
    }
    ctx_.forward(b, o, true);
    // positions the proposer could never read are skipped: it only needs the count
    if (cap) give_features(off, m, grab ? ctx_.captured() : nullptr, nullptr, grab ? prompt + off : nullptr);
    if (progress_ && !progress_(off + m, n)) fail("prefill cancelled after %d of %d prompt tokens", off + m, n);
  }
  const uint32_t* mask = nullptr;
  if (constraint_) {  // node 0 = the last prompt token: its mask is the empty reply's
    masks_.assign((size_t)mask_words(ctx_.model().cfg.n_vocab), 0u);
    const int32_t parent = -1;
    constraint_->masks(1, prompt + n - 1, &parent, 0, masks_.data());
    mask = masks_.data();
  }
  pending_ = need_rows() ? pick(logits_.data(), n, nullptr, 0, mask) : top_ids_[0];
  if (constraint_) constraint_->commit(&pending_, 1);
  if (p_.n_logprobs >= 0) record_logprob(0, pending_);
}

void Generator::record_logprob(int node, int32_t token) {
  const int V = ctx_.model().cfg.n_vocab, K = row_k();
  TokenLogprob e;
  e.token = token;
  e.n_top = std::min(p_.n_logprobs, V);
  if (!need_rows()) {  // the device's top-k of the row: the choice is its first entry
    const int32_t* ids = top_ids_.data() + (size_t)node * K;
    const float* lp = top_logp_.data() + (size_t)node * K;
    e.logp = lp[0];
    for (int i = 0; i < e.n_top; ++i) e.top_ids[i] = ids[i], e.top_logp[i] = lp[i];
  } else {  // the raw row (before temperature and filters): its log-softmax
    const float* row = logits_.data() + (size_t)node * V;
    int32_t ids[kMaxLogprobs + 1];
    float lp[kMaxLogprobs + 1];
    topk_logprobs(row, V, 1 + e.n_top > V ? V : 1 + e.n_top, ids, lp);
    e.logp = row[token] - (row[ids[0]] - lp[0]);  // lse = row[top] - logp[top]
    for (int i = 0; i < e.n_top; ++i) e.top_ids[i] = ids[i], e.top_logp[i] = lp[i];
  }
  logprobs_.push_back(e);
}

int32_t Generator::pick(const float* row, int64_t pos, const int32_t* extra, int n_extra, const uint32_t* mask) {
  const int V = ctx_.model().cfg.n_vocab;
  // each stage below edits the row in row_scratch_, copied there by the first that runs
  auto own_row = [&] {
    if (row != row_scratch_.data()) row_scratch_.assign(row, row + V), row = row_scratch_.data();
  };
  if (mask) {  // the constraint first: what it forbids is out before penalties, filters and the draw
    own_row();
    bool any = false;
    for (int t = 0; t < V; ++t) {
      if (mask_allows(mask, t)) any = true;
      else row_scratch_[(size_t)t] = -INFINITY;
    }
    if (!any) fail("the constraint allows no token at position %lld", (long long)pos);
  }
  if (p_.sampler.biased()) {  // then the bias, as every position's row gets it (before the penalties)
    own_row();
    for (const auto& [t, b] : p_.sampler.logit_bias) row_scratch_[(size_t)t] += b;
  }
  if (!p_.sampler.penalized()) return sample_token(row, V, p_.sampler, pos, sample_scratch_);
  // the node's own sequence: the committed tokens, then its ancestors and itself
  const size_t n0 = hist_.size();
  hist_.insert(hist_.end(), extra, extra + n_extra);
  own_row();
  apply_penalties(row_scratch_.data(), V, p_.sampler, hist_.data(), hist_.size(), penalty_scratch_);
  hist_.resize(n0);
  return sample_token(row_scratch_.data(), V, p_.sampler, pos, sample_scratch_);
}

bool Generator::is_eos(int32_t t) const {
  return !p_.ignore_eos && std::find(p_.eos_ids.begin(), p_.eos_ids.end(), t) != p_.eos_ids.end();
}

int Generator::next(std::vector<int32_t>& out) {
  if (done_) return 0;
  if (!first_emitted_) {
    // The prefill's token belongs to no step (z-lab's convention).
    first_emitted_ = true;
    if (is_eos(pending_)) {
      done_ = true;
      stats_.stop = StopReason::Eos;
      logprobs_.clear();  // the prefill's token was not emitted
      return 0;
    }
    out.push_back(pending_);
    stats_.generated_tokens = 1;
    if (stats_.generated_tokens >= p_.max_new_tokens) {
      done_ = true;
      stats_.stop = StopReason::Length;
    }
    return 1;
  }
  auto t0 = Clock::now();
  int n = step(out);
  stats_.decode_s += since(t0);
  return n;
}

void Generator::draft_chain(int32_t s, int V, StepRecord& rec) {
  for (int i = 1; i < V; ++i) {
    parent_[i] = i - 1;
    depth_[i] = i;
  }
  if (V < 2) return;
  auto t0 = Clock::now();
  first(Proposer::Chain)->propose_chain(request(s, V), tokens_.data() + 1);
  if (constraint_) {  // what the constraint forces comes first: drafts that cannot miss
    const std::vector<int32_t> f = forced_tokens(V - 1);
    std::copy(f.begin(), f.end(), tokens_.begin() + 1);
  }
  rec.draft_s += since(t0);  // (+: a slot's share of a batched drafter forward, next_many's)
}

// The tree with the constraint's forced tokens as its first chain (depth 1..nf, log-prob 0: certain); a
// drafted node within those depths survives only as that chain, deeper ones hang under it when their
// ancestors agree with it.  Builder order (parents first, the certain nodes before the rest) is kept.
static DraftTree graft_forced(const DraftTree& t, const int32_t* f, int nf) {
  DraftTree g;
  const bool tagged = !t.tag.empty();
  for (int d = 1; d <= nf; ++d) {
    g.tokens.push_back(f[d - 1]);
    g.depth.push_back(d);
    g.parent.push_back(d - 1);
    g.logp.push_back(0.f);
    if (tagged) g.tag.push_back(0);  // the constraint's, no drafter's
  }
  std::vector<int32_t> at((size_t)t.size() + 1, -1);  // old node -> new node (0 = the root)
  at[0] = 0;
  for (int i = 1; i <= t.size(); ++i) {
    const int d = t.depth[(size_t)i - 1], p = at[(size_t)t.parent[(size_t)i - 1]];
    if (p < 0) continue;
    if (d <= nf) {  // on the forced chain or gone
      if (t.tokens[(size_t)i - 1] == f[d - 1] && p == d - 1) at[(size_t)i] = d;
      continue;
    }
    g.tokens.push_back(t.tokens[(size_t)i - 1]);
    g.depth.push_back(d);
    g.parent.push_back(p);
    g.logp.push_back(t.logp[(size_t)i - 1]);
    if (tagged) g.tag.push_back(t.tag[(size_t)i - 1]);
    at[(size_t)i] = g.size();
  }
  return g;
}

Generator::TreeDrafter Generator::tree_drafter() const {
  TreeDrafter d;
  d.whole = p_.mode == DecodeMode::DDTree ? first(Proposer::Tree) : nullptr;
  if (d.whole) return d;
  // Expanding branches, or a ranking proposer whose children depend on their parent (the first that ranks,
  // in order of preference): the proposer builds the tree itself; else one ranking, then the builder.
  d.rank = ranker();
  d.expander = p_.tree.expand > 0 ? (chosen_ >= 0 ? (d.rank->can(Proposer::Expand) ? d.rank : nullptr)
                                                  : first(Proposer::Expand))
                                  : nullptr;
  if (!d.expander && d.rank && d.rank->can(Proposer::OwnTree)) d.expander = d.rank;
  return d;
}

void Generator::draft_tree(int32_t s, int V, int room, StepRecord& rec, bool probe, bool look) {
  const int n_vocab = ctx_.model().cfg.n_vocab;
  const int cap = tree_cap(room);
  const TreeDrafter td = tree_drafter();
  Proposer* whole = td.whole;
  TreeParams tp = step_tree(room, whole != nullptr);
  auto t0 = Clock::now();
  DraftTree t;
  if (whole) {  // a proposer that gives the whole tree (a hook): verified as given
    t = whole->propose_tree(request(s, V), tp, 0);
    rec.draft_s += since(t0);
  } else {
    if (V < 2 || cap <= 0) {
      tokens_.resize(1), parent_.resize(1), depth_.resize(1);
      return;
    }
    const int K = ddtree_k(tp, n_vocab);
    Proposer *rank = td.rank, *expander = td.expander;
    if (expander) {
      t = expander->propose_tree(request(s, V), tp, K);
    } else {
      top_ids_.resize((size_t)(V - 1) * K), top_logp_.resize((size_t)(V - 1) * K);
      rank->propose_topk(request(s, V), K, top_ids_.data(), top_logp_.data());
    }
    rec.draft_s += since(t0);
    t0 = Clock::now();
    if (!expander) t = build_ddtree_topk(top_ids_.data(), top_logp_.data(), V - 1, K, tp);
    // (tp.budget: the cap, or under a pruning constraint the overdraft that constrain_tree cuts to the cap)
    if (p_.mode == DecodeMode::Auto && merge_trees_) merge_weightless_drafter(s, room, tp, tp.budget, t);
  }
  if (constraint_ && !whole) {
    const std::vector<int32_t> f = forced_tokens(V - 1);
    if (!f.empty()) t = graft_forced(t, f.data(), (int)f.size());
    constrain_tree(t, cap, rec);
  }
  if (p_.mode == DecodeMode::Auto) {
    // a drafter with nothing to propose (prompt lookup without a match) explored nothing: not a probe in the
    // step's record (its first probe stays due; the empty draft cost nothing)
    if (t.size() == 0) rec.probe = false;
    // The builder adds nodes best-first: the tree of budget b is the first b
    // nodes, so one draft prices every budget.
    AutoController& ac = autos_[(size_t)chosen_];
    const double max_worst = allowed_loss_s(ac, probe) - rec.draft_s;  // the draft is spent
    const AutoChoice c = ac.choose(t.depth.data(), t.logp.data(), t.size(), probe, look, work_.slots, max_worst);
    if (work_.merged_with >= 0) {
      ac.keep_forecast(work_.own.depth.data(), work_.own.logp.data(), work_.own.size());
      for (int i = 0; i < c.budget; ++i)  // (tag 0: a node the constraint forced, no drafter's)
        rec.merged += t.tag[(size_t)i] > 0 && work_.own_index(t.tag[(size_t)i]) == 0;
    }
    rec.auto_budget = c.budget;
    rec.expected = c.expected, rec.est_tok_s = c.tok_s, rec.est_ar_tok_s = c.ar_tok_s;
    auto_tree_ = t;
    for (auto* v : {&t.tokens, &t.depth, &t.parent}) v->resize((size_t)c.budget);
    t.logp.resize((size_t)c.budget);
  }
  const int n = t.size();
  tokens_.resize(n + 1), parent_.resize(n + 1), depth_.resize(n + 1);
  for (int i = 1; i <= n; ++i) {
    tokens_[i] = t.tokens[i - 1];
    parent_[i] = t.parent[i - 1];
    depth_[i] = t.depth[i - 1];
  }
  if (!whole) rec.tree_s = since(t0);
}

void Generator::merge_weightless_drafter(int32_t s, int room, const TreeParams& tp, int cap, DraftTree& t) {
  AutoController& ac = autos_[(size_t)chosen_];
  // a drafter's first probe measures it alone; a weightless drafter's own step has nothing cheaper to add
  if (!ac.measured() || drafters_[(size_t)chosen_]->weightless()) return;
  for (size_t j = 0; j < drafters_.size(); ++j) {
    // (a weightless drafter builds its own tree: prompt lookup's trie)
    if ((int)j == chosen_ || !drafters_[j]->weightless() || !drafters_[j]->can(Proposer::OwnTree)) continue;
    const int V = std::min({block_of((int)j), work_.remaining + 1, room});
    if (V < 2) return;
    DraftTree b = drafters_[j]->propose_tree(request(s, V), tp, ddtree_k(tp, ctx_.model().cfg.n_vocab));
    if (b.size() == 0) return;  // (lookup without a match)
    // each node's chance to be accepted by its own drafter's calibration
    const AutoController& bc = autos_[j];
    std::vector<double> qa((size_t)t.size()), qb((size_t)b.size());
    for (int i = 0; i < t.size(); ++i)
      qa[(size_t)i] = std::min(1.0, ac.estimates().calib(t.depth[(size_t)i]) * std::exp((double)t.logp[(size_t)i]));
    for (int i = 0; i < b.size(); ++i)
      qb[(size_t)i] = std::min(1.0, bc.estimates().calib(b.depth[(size_t)i]) * std::exp((double)b.logp[(size_t)i]));
    TreeUnion u = merge_trees(t, qa.data(), b, qb.data());
    const int n = std::min(u.tree.size(), cap);  // best-first, parents first: a prefix is a tree
    for (auto* v : {&u.tree.tokens, &u.tree.depth, &u.tree.parent}) v->resize((size_t)n);
    u.tree.logp.resize((size_t)n), u.from_a.resize((size_t)n);
    // the chosen controller prices a node as calib(depth) x exp(logp): the log-prob that makes that its q
    for (int i = 0; i < n; ++i)
      u.tree.logp[(size_t)i] =
          (float)(std::log(std::max(u.q[(size_t)i], 1e-30)) - std::log(ac.estimates().calib(u.tree.depth[(size_t)i])));
    u.tree.tag.resize((size_t)n);
    for (int i = 0; i < n; ++i) u.tree.tag[(size_t)i] = i + 1;  // the union's node, through a constraint's rewrite
    work_.merged_with = (int)j;
    work_.own = std::move(t);
    work_.added = std::move(b);
    work_.union_from_own = std::move(u.from_a);
    t = std::move(u.tree);
    return;  // one weightless drafter a step
  }
}

void Generator::constrain_tree(DraftTree& t, int cap, StepRecord& rec) {
  // unpruned, the first cap nodes are the tree; pruned, the first cap the masks allow (the matcher stops there)
  const int N = (prune_ ? t.size() : std::min(t.size(), cap)) + 1;
  const size_t words = (size_t)mask_words(ctx_.model().cfg.n_vocab);
  auto t0 = Clock::now();
  std::vector<int32_t> tok((size_t)N), par((size_t)N);
  tok[0] = pending_, par[0] = -1;
  for (int i = 1; i < N; ++i) tok[(size_t)i] = t.tokens[(size_t)i - 1], par[(size_t)i] = t.parent[(size_t)i - 1];
  masks_.assign((size_t)N * words, 0u);
  constraint_->masks(N, tok.data(), par.data(), cap, masks_.data());
  // keep, in builder order (best first, parents first), the nodes whose parent is kept and allows them,
  // up to cap: a prefix-closed tree whose masks stay row-aligned with its nodes
  DraftTree kept;
  std::vector<int32_t> new_index((size_t)N, -1);
  new_index[0] = 0;
  int forbidden = 0, read = 1;
  for (int i = 1; i < N && kept.size() < cap; ++i) {
    read = i + 1;
    const int p = par[(size_t)i];
    if (new_index[(size_t)p] < 0 || (prune_ && !mask_allows(masks_.data() + (size_t)p * words, tok[(size_t)i]))) {
      ++forbidden;  // forbidden, or under a forbidden node
      continue;
    }
    const int m = kept.size() + 1;
    new_index[(size_t)i] = m;
    kept.tokens.push_back(tok[(size_t)i]);
    kept.depth.push_back(t.depth[(size_t)i - 1]);
    kept.parent.push_back(new_index[(size_t)p]);
    kept.logp.push_back(t.logp[(size_t)i - 1]);
    if (!t.tag.empty()) kept.tag.push_back(t.tag[(size_t)i - 1]);
    if (m != i) std::copy_n(masks_.data() + (size_t)i * words, words, masks_.data() + (size_t)m * words);
  }
  masks_.resize((size_t)(kept.size() + 1) * words);
  t = std::move(kept);
  rec.pruned = forbidden;
  rec.masked = read;
  rec.mask_s = since(t0);
  masks_ready_ = true;
}

void Generator::constrain_step(StepRecord& rec) {
  // a chain (or an AR step with forced tokens) goes through the trees' one masking and pruning path
  DraftTree t;
  for (size_t i = 1; i < tokens_.size(); ++i) {
    t.tokens.push_back(tokens_[i]);
    t.depth.push_back(depth_[i]);
    t.parent.push_back(parent_[i]);
    t.logp.push_back(0.f);
  }
  constrain_tree(t, t.size(), rec);
  tokens_.resize(1), parent_.resize(1), depth_.resize(1);
  tokens_.insert(tokens_.end(), t.tokens.begin(), t.tokens.end());
  parent_.insert(parent_.end(), t.parent.begin(), t.parent.end());
  depth_.insert(depth_.end(), t.depth.begin(), t.depth.end());
}

std::vector<int32_t> Generator::forced_tokens(int cap) {
  std::vector<int32_t> f((size_t)std::max(cap, 0));
  f.resize((size_t)(cap > 0 ? constraint_->forced(f.data(), cap) : 0));
  return f;
}

int Generator::step(std::vector<int32_t>& out) {
  if (!plan_step(1)) return 0;
  ctx_.forward(work_.b, work_.o, work_.commit);
  return finish_step(out);
}

int Generator::next_many(Generator* const* gs, int n, std::vector<int32_t>* outs) {
  // the first token of a request comes from its prefill: emitted without a forward
  std::vector<int> stepping;  // indices into gs
  int total = 0;
  for (int k = 0; k < n; ++k) {
    Generator& g = *gs[k];
    if (g.done_) continue;
    if (!g.first_emitted_) {
      total += g.next(outs[k]);
      continue;
    }
    stepping.push_back(k);
  }
  const auto t0 = Clock::now();
  std::vector<int> planned;
  for (int k : stepping)  // auto mode prices each tree against the whole batch's step
    if (gs[k]->decide_step((int)stepping.size())) planned.push_back(k);
  // the slots whose blocks one drafter forward can make (a DFlash drafter's, shared): drafted together first
  std::vector<bool> grouped(planned.size(), false);
  std::vector<Proposer*> ps(planned.size());
  std::vector<DraftRequest> rs(planned.size());
  for (size_t i = 0; i < planned.size(); ++i) ps[i] = gs[planned[i]]->block_proposer(&rs[i]);
  for (size_t i = 0; i < planned.size(); ++i) {
    if (grouped[i] || !ps[i] || !ps[i]->batch_key()) continue;
    std::vector<Proposer*> gp;
    std::vector<DraftRequest> gr;
    std::vector<size_t> members;
    for (size_t j = i; j < planned.size(); ++j)
      if (!grouped[j] && ps[j] && ps[j]->batch_key() == ps[i]->batch_key()) {
        gp.push_back(ps[j]), gr.push_back(rs[j]), members.push_back(j);
        grouped[j] = true;
      }
    if (gp.size() < 2) continue;
    const auto tp = Clock::now();
    gp[0]->prefetch_many(gp.data(), gr.data(), (int)gp.size());
    const double dt = since(tp);  // each slot of the group waited the whole forward (its draft time, as alone)
    for (size_t j : members) {
      StepRecord& rec = gs[planned[j]]->work_.rec;
      rec.draft_batch = (int)gp.size();
      rec.draft_s = dt;
    }
  }
  for (int k : planned) gs[k]->draft_step();
  // the verify batches in as few forwards as the batch size allows (usually one): slots in order, each forward
  // as many as fit its first context's batch
  std::vector<Context*> cs;
  std::vector<Batch> bs;
  std::vector<ForwardOutputs> os;
  std::unique_ptr<bool[]> commit(new bool[planned.size() + 1]);
  for (size_t i = 0; i < planned.size(); ++i) {
    const Generator& g = *gs[planned[i]];
    cs.push_back(&g.ctx_);
    bs.push_back(g.work_.b);
    os.push_back(g.work_.o);
    commit[i] = g.work_.commit;
  }
  for (size_t i0 = 0, i = 0; i0 < planned.size(); i0 = i) {
    for (int rows = 0; i < planned.size() && (i == i0 || rows + bs[i].n <= cs[i0]->params().n_batch); ++i)
      rows += bs[i].n;
    Context::forward_many(cs.data() + i0, bs.data() + i0, os.data() + i0, commit.get() + i0, (int)(i - i0));
  }
  for (int k : planned) total += gs[k]->finish_step(outs[k]);
  const double dt = since(t0);  // each stepping request waited the whole shared step
  for (int k : stepping) gs[k]->stats_.decode_s += dt;
  return total;
}

bool Generator::plan_step(int slots) {
  if (!decide_step(slots)) return false;
  draft_step();
  return true;
}

bool Generator::decide_step(int slots) {
  const int32_t s = ctx_.n_past();
  const int room = ctx_.params().n_ctx - s;
  if (room <= 0) {
    done_ = true;
    stats_.stop = StopReason::ContextFull;
    return false;
  }
  const int remaining = p_.max_new_tokens - stats_.generated_tokens;  // >= 1 here
  // The draft block shrinks at the end (as z-lab's loop) and to the room left.
  int V = std::min({block_, remaining + 1, room});
  work_ = StepWork{};
  work_.slots = slots;
  StepRecord& rec = work_.rec;
  work_.s = s, work_.remaining = remaining;
  work_.fwd0 = ctx_.n_forwards();

  // ---- DRAFT ---- a chain or a tree rooted at the pending token (node 0)
  tokens_.assign(std::max(V, 1), 0);
  parent_.assign(tokens_.size(), -1);
  depth_.assign(tokens_.size(), 0);
  tokens_[0] = pending_;
  bool speculate = p_.mode == DecodeMode::DDTree, look = false;
  chosen_ = -1;
  if (p_.mode == DecodeMode::Auto) {
    // the portfolio: each drafter's controller says what it would do; a drafter expected to beat AR goes first
    // (the best expected tokens/s), then a due probe (in order of preference, one a step), then a free drafter's
    // look at this step's own tree
    std::vector<AutoController::Wish> wish(autos_.size());
    std::vector<int> rows(autos_.size());
    int k = -1;
    for (size_t i = 0; i < drafters_.size(); ++i) {
      rows[i] = std::min({block_of((int)i), remaining + 1, room});
      autos_[i].price_block(rows[i]);  // the block it would draft
      wish[i] = autos_[i].wish(remaining, work_.slots);
      // a drafter that pays a forward per depth drafts only the depths its expected tree reaches, and one more
      // (the tree can grow a depth a step): the tiny MTP head's 3 depths cost 0.7 ms against 0.27 ms for one,
      // and a chain of one that it wins is an AR step's worth of drafting when it drafts all of them.  Depths
      // that save next to nothing (a 27B's head on a GPU: a few % of an AR step each) are drafted anyway: the
      // tree then need not grow back a depth a step after a miss.
      const int fit = std::max(2, wish[i].forecast.depth + 2);
      if (drafters_[i]->drafts_by_depth() && wish[i].draft && fit < rows[i]) {
        const AutoEstimates& e = autos_[i].estimates();  // (draft_s: the whole block's, as priced above)
        if (e.draft_s * (rows[i] - fit) / (rows[i] - 1) > AutoController::kFreeDraftShare * e.ar_s) {
          rows[i] = fit;
          autos_[i].price_block(fit);
          wish[i] = autos_[i].wish(remaining, work_.slots);
        }
      }
      const AutoController::Wish& w = wish[i];
      // a bet (or a probe) the request cannot afford to lose is not made, however good its odds
      if (!w.draft || autos_[i].worst_loss_s(work_.slots) > allowed_loss_s(autos_[i], w.probe)) continue;
      const AutoController::Wish* best = k >= 0 ? &wish[(size_t)k] : nullptr;
      if (!best || w.rank() > best->rank() ||
          (w.rank() == 3 && best->rank() == 3 && w.forecast.tok_s > best->forecast.tok_s))
        k = (int)i;
    }
    for (size_t i = 0; i < drafters_.size(); ++i) autos_[i].decided(wish[i], (int)i == k, remaining);
    const AutoChoice forecast = k >= 0 ? wish[(size_t)k].forecast : !wish.empty() ? wish[0].forecast : AutoChoice{};
    if (k >= 0) V = rows[(size_t)k];
    speculate = k >= 0 && V >= 2 && room >= 2 && p_.tree.budget > 0;
    if (speculate) chosen_ = k;
    rec.drafter = chosen_;
    rec.probe = speculate && wish[(size_t)k].probe;
    look = speculate && wish[(size_t)k].look;
    rec.auto_budget = 0;
    rec.expected = 1.0, rec.est_tok_s = forecast.ar_tok_s, rec.est_ar_tok_s = forecast.ar_tok_s;
  }
  work_.speculate = speculate, work_.look = look, work_.V = V, work_.room = room;
  return true;
}

double Generator::allowed_loss_s(const AutoController& ac, bool probe) const {
  return ac.measured() ? allowance_.bet_s(ac.ar_step_s(), probe) : 1e300;
}

TreeParams Generator::step_tree(int room, bool whole) const {
  TreeParams tp = p_.tree;
  tp.budget = tree_cap(room);
  if (whole) return tp;  // a hook's whole tree: verified as given
  // Under a constraint that prunes, draft more than fits and keep the best `cap` the constraint allows:
  // forbidden branches make room for allowed ones instead of leaving the verify short.
  const bool overdraft = constraint_ && prune_;
  if (overdraft) tp.budget = std::min({tp.budget * kOverdraft, room - 1, ctx_.params().n_batch - 1});
  if (tp.topk <= 0) tp.topk = overdraft ? tp.budget : p_.tree.budget;  // K from the budget, not the room left
  return tp;
}

Proposer* Generator::block_proposer(DraftRequest* r) const {
  // the proposer draft_tree / draft_chain will ask for this step's block, as they choose it
  const int V = work_.V, room = work_.room;
  if (V < 2) return nullptr;
  Proposer* p = nullptr;
  if (work_.speculate) {
    const TreeDrafter td = tree_drafter();
    if (tree_cap(room) <= 0 || td.whole) return nullptr;  // nothing drafted, or a hook's whole tree
    p = td.expander ? td.expander : td.rank;
  } else if (p_.mode == DecodeMode::Chain) {
    p = first(Proposer::Chain);
  }
  if (p) {
    *r = request(work_.s, V);
    // the ranks per depth its propose call will ask for (a chain: the top-1)
    r->K = work_.speculate ? ddtree_k(step_tree(room, false), ctx_.model().cfg.n_vocab) : 1;
    r->expand = work_.speculate && p->can(Proposer::Expand) && p_.tree.expand > 0;
  }
  return p;
}

void Generator::draft_step() {
  const Qwen35Config& c = ctx_.model().cfg;
  StepRecord& rec = work_.rec;
  const int32_t s = work_.s;
  const int V = work_.V, room = work_.room;
  const bool speculate = work_.speculate, look = work_.look;
  if (speculate || (p_.mode == DecodeMode::Chain && V >= 2)) rec.draft_depth = V - 1;
  if (speculate) {
    draft_tree(s, V, room, rec, rec.probe, look);
  } else if (p_.mode == DecodeMode::Chain) {
    draft_chain(s, V, rec);
  } else {
    tokens_.resize(1), parent_.resize(1), depth_.resize(1);  // an AR step: the root alone
    if (p_.mode == DecodeMode::Auto && constraint_ && V >= 2 && room >= 2) {
      // what the constraint forces costs no draft and cannot miss: verify it with the root
      for (int32_t t : forced_tokens(V - 1)) {
        parent_.push_back((int32_t)tokens_.size() - 1);
        depth_.push_back((int32_t)tokens_.size());
        tokens_.push_back(t);
      }
    }
  }
  for (size_t i = 1; i < tokens_.size(); ++i)
    if (tokens_[i] < 0 || tokens_[i] >= c.n_vocab) fail("draft token %d outside the vocabulary", tokens_[i]);
  if (constraint_ && !masks_ready_) constrain_step(rec);
  masks_ready_ = false;
  const int N = (int)tokens_.size();
  rec.drafted = N - 1;
  rec.tree_depth = N > 1 ? *std::max_element(depth_.begin(), depth_.end()) : 0;

  // ---- VERIFY ---- one target forward over the root and every draft node
  work_.t0 = Clock::now();
  pos_.resize(N);
  std::vector<int32_t>& rows = work_.rows;
  rows.resize(N);
  for (int i = 0; i < N; ++i) pos_[i] = s + depth_[i], rows[i] = i;
  work_.b = Batch{N, tokens_.data(), pos_.data(), parent_.data()};
  ForwardOutputs& o = work_.o;
  o.n_logits = N;
  o.logit_rows = rows.data();
  const int K = row_k();
  if (!need_rows()) {
    top_ids_.resize((size_t)N * K), top_logp_.resize((size_t)N * K);
    o.topk = K, o.top_ids = top_ids_.data(), o.top_logp = logp_rows();
  } else {
    logits_.resize((size_t)N * c.n_vocab);
    o.logits = logits_.data();
  }
  const bool cap = capturing();
  if (cap) {
    o.n_capture = (int)capture_.size();
    o.capture_layers = capture_.data();
    o.hidden_on_backend = true;
  }
  // AR, and auto's AR steps, append the root directly; everything else verifies then commits.
  work_.commit = p_.mode == DecodeMode::AR || (p_.mode == DecodeMode::Auto && N == 1);
}

int Generator::finish_step(std::vector<int32_t>& out) {
  const Qwen35Config& c = ctx_.model().cfg;
  StepRecord& rec = work_.rec;
  const int32_t s = work_.s;
  const int remaining = work_.remaining;
  const int N = work_.b.n, K = row_k();
  const bool ar = work_.commit, cap = capturing(), speculate = work_.speculate;
  const int64_t fwd0 = work_.fwd0;
  auto t0 = work_.t0;
  // ACCEPT: from the root, follow the child holding the target's choice (its
  // argmax, or its sample with the number of the position that token takes).
  std::vector<int32_t> path{0};
  std::vector<int32_t> path_tokens;  // the tokens root..node along the walk (penalties count them)
  const size_t words = (size_t)mask_words(c.n_vocab);
  auto choice_at = [&](int node) {
    if (!need_rows()) return top_ids_[(size_t)node * K];
    path_tokens.push_back(tokens_[node]);
    return pick(logits_.data() + (size_t)node * c.n_vocab, s + depth_[node] + 1, path_tokens.data(),
                (int)path_tokens.size(), constraint_ ? masks_.data() + (size_t)node * words : nullptr);
  };
  int32_t choice = choice_at(0);
  for (;;) {
    const int cur = path.back();
    int next = -1;
    for (int i = cur + 1; i < N && next < 0; ++i)
      if (parent_[i] == cur && tokens_[i] == choice) next = i;
    if (next < 0) break;
    path.push_back(next);
    choice = choice_at(next);
  }
  const int32_t bonus = choice;
  const int a = (int)path.size() - 1;
  rec.verify_s = since(t0);
  rec.accepted = a;

  // ---- COMMIT ---- gather the accepted nodes; nothing is re-run
  t0 = Clock::now();
  for (int i = 0; i <= a; ++i) hist_.push_back(tokens_[path[i]]);  // positions s .. s + a are committed
  if (!ar) ctx_.commit_path(path.data(), a + 1);
  // the accepted nodes' features, in path order, copied on the backend (nodes off the path leave no trace);
  // auto's AR steps keep the features whole
  if (cap) give_features(s, a + 1, ctx_.captured(), ar ? nullptr : path.data(), hist_.data() + s);
  rec.commit_s = since(t0);
  rec.target_forwards = (int)(ctx_.n_forwards() - fwd0);
  if (constraint_) {  // the matcher follows every decided token: the accepted drafts, then the bonus
    std::vector<int32_t> decided;
    for (int i = 1; i <= a; ++i) decided.push_back(tokens_[path[i]]);
    decided.push_back(bonus);
    constraint_->commit(decided.data(), (int)decided.size());
  }

  // ---- EMIT ---- accepted drafts, then the bonus, within max_new_tokens
  const int produced = std::min(a + 1, remaining);
  int emitted = 0;
  rec.committed = produced;
  for (int i = 0; i < produced; ++i) {
    const int32_t t = i < a ? tokens_[path[i + 1]] : bonus;
    if (is_eos(t)) {
      rec.committed = i + 1;
      done_ = true;
      stats_.stop = StopReason::Eos;
      break;
    }
    out.push_back(t);
    if (p_.n_logprobs >= 0) record_logprob(path[i], t);  // node path[i] predicted the i-th token
    ++emitted;
  }
  stats_.generated_tokens += emitted;
  pending_ = bonus;
  if (p_.mode == DecodeMode::Auto) {  // what the step teaches the controller
    if (N == 1)  // an AR step's cost is every drafter's baseline
      for (AutoController& ac : autos_) ac.observe_ar(rec.verify_s + rec.commit_s);
    if (speculate) {
      const AutoController& chosen = autos_[(size_t)chosen_];
      allowance_.settle(rec, chosen.ar_step_s(), chosen.expected_step_s(rec.auto_budget));
      std::vector<uint8_t> on_path((size_t)std::max(rec.auto_budget, 0), 0);
      for (int i = 1; i <= a; ++i) on_path[(size_t)path[i] - 1] = 1;  // (a constraint pruned before the choice)
      auto decline = [&](int drafter, const DraftTree& t) {  // learnt once its tokens are decided
        if (t.size() == 0) return;
        if (declined_.size() == kMaxDeclined) declined_.erase(declined_.begin());
        declined_.push_back(Declined{drafter, s, t});
      };
      if (work_.merged_with < 0) {
        autos_[(size_t)chosen_].observe_spec(rec, auto_tree_.depth.data(), auto_tree_.logp.data(),
                                             rec.auto_budget, on_path);
        if (rec.auto_budget == 0) decline(chosen_, auto_tree_);  // drafted, then AR won
      } else {
        // a union (tree_merge.h): the chosen drafter learns from its own verified nodes, with its own
        // log-probs; the weightless drafter's whole tree is learnt as a declined one once its tokens are decided
        const DraftTree& own = work_.own;
        std::vector<int32_t> depth;
        std::vector<float> logp;
        std::vector<uint8_t> on;
        for (int i = 0; i < rec.auto_budget; ++i)
          if (const int32_t k = work_.own_index(auto_tree_.tag[(size_t)i])) {
            depth.push_back(own.depth[(size_t)k - 1]), logp.push_back(own.logp[(size_t)k - 1]);
            on.push_back(on_path[(size_t)i]);
          }
        autos_[(size_t)chosen_].observe_spec(rec, depth.data(), logp.data(), rec.auto_budget, on, (int)on.size());
        if (rec.auto_budget == 0) decline(chosen_, own);
        decline(work_.merged_with, work_.added);
      }
    }
    // an AR step's masks under a constraint: every drafter's baseline (a tree's are its drafter's, observe_spec)
    if (rec.masked > 0 && !speculate)
      for (AutoController& ac : autos_) ac.observe_ar_masks(rec.mask_s);
    rec.declined_learnt = resolve_declined();
  }
  steps_.push_back(rec);
  stats_.steps = (int)steps_.size();
  if (!done_ && stats_.generated_tokens >= p_.max_new_tokens) {
    done_ = true;
    stats_.stop = StopReason::Length;
  }
  return emitted;
}

void Generator::measure_verify(int max_nodes) {
  if (drafters_.empty() || hist_.empty()) return;  // nothing to price, or no committed text to verify after
  const int s = ctx_.n_past();
  const int cap = std::min({max_nodes, ctx_.params().n_batch, ctx_.params().n_ctx - s});
  std::vector<int32_t> tok, pos, par, rows, ids;
  std::vector<float> logp;
  std::vector<int> sizes;
  for (int n = 2; n <= cap; n *= 2) sizes.push_back(n);  // between sizes the estimate interpolates
  if (cap >= 2 && (sizes.empty() || sizes.back() != cap)) sizes.push_back(cap);
  for (int n : sizes) {
    tok.assign((size_t)n, hist_.back()), pos.resize((size_t)n), par.resize((size_t)n), rows.resize((size_t)n);
    for (int i = 0; i < n; ++i) pos[(size_t)i] = s + i, par[(size_t)i] = i - 1, rows[(size_t)i] = i;
    ids.resize((size_t)n), logp.resize((size_t)n);
    ForwardOutputs o;  // the top-k a step's verify takes (its log-probs only where logprobs are asked)
    o.n_logits = n, o.logit_rows = rows.data(), o.topk = 1, o.top_ids = ids.data();
    o.top_logp = p_.n_logprobs >= 0 ? logp.data() : nullptr;
    if (!readers_.empty()) {  // a step's verify captures the feature readers' rows too
      o.n_capture = (int)capture_.size(), o.capture_layers = capture_.data(), o.hidden_on_backend = true;
    }
    double best = 1e300;
    for (int rep = 0; rep < 2; ++rep) {  // the faster of two: a step's verify runs with its weights warm
      const auto t0 = Clock::now();
      ctx_.forward(Batch{n, tok.data(), pos.data(), par.data()}, o, /*commit=*/false);
      best = std::min(best, since(t0));
    }
    for (AutoController& ac : autos_) ac.observe_verify(n, best);
  }
}

int Generator::resolve_declined() {
  // The decided token at an absolute position: committed (hist_), the pending bonus, or not yet (-1).
  const int64_t n_hist = (int64_t)hist_.size();
  auto decided = [&](int64_t pos) -> int64_t { return pos < n_hist ? hist_[(size_t)pos] : pos == n_hist ? pending_ : -1; };
  std::vector<int8_t> on;  // per node: 1 on the decided text, 0 off it, -1 not known yet
  std::vector<uint8_t> hit;
  int learnt = 0;
  for (size_t k = 0; k < declined_.size();) {
    const Declined& d = declined_[k];
    const DraftTree& t = d.tree;
    on.assign((size_t)t.size(), -1);
    bool known = true;
    for (int i = 0; i < t.size(); ++i) {  // builder order: a parent before its children
      const int p = t.parent[(size_t)i];
      const int8_t up = p == 0 ? 1 : on[(size_t)p - 1];
      if (up <= 0) {
        on[(size_t)i] = up;  // under a node off the text: off; under an unknown one: unknown
      } else {
        const int64_t tok = decided((int64_t)d.root_pos + t.depth[(size_t)i]);
        on[(size_t)i] = tok < 0 ? -1 : tok == t.tokens[(size_t)i] ? 1 : 0;
      }
      known &= on[(size_t)i] >= 0;
    }
    if (!known) {
      ++k;
      continue;
    }
    hit.assign(on.begin(), on.end());
    autos_[(size_t)d.drafter].observe_declined(t.depth.data(), t.logp.data(), t.size(), hit.data());
    declined_.erase(declined_.begin() + (std::ptrdiff_t)k);
    ++learnt;
  }
  return learnt;
}

}  // namespace dfl

// proposer.cpp — the Proposer defaults: a chain from the ranking's top-1; asking a proposer for a shape it
// did not declare is an internal error (the Generator picks by capability).
#include "spec/proposer.h"

#include "util/error.h"

namespace dfl {

void Proposer::propose_topk(const DraftRequest&, int, int32_t*, float*) {
  fail("internal: the %s proposer cannot rank draft tokens", name());
}

void Proposer::propose_chain(const DraftRequest& r, int32_t* tokens) {
  if (!can(Rank)) fail("internal: the %s proposer cannot draft a chain", name());
  chain_ids_.resize((size_t)r.L), chain_logp_.resize((size_t)r.L);
  propose_topk(r, 1, chain_ids_.data(), chain_logp_.data());
  for (int i = 0; i < r.L; ++i) tokens[i] = chain_ids_[(size_t)i];
}

DraftTree Proposer::propose_tree(const DraftRequest&, const TreeParams&, int) {
  fail("internal: the %s proposer cannot draft a tree itself", name());
}

}  // namespace dfl

// handles.h — the definitions of the C handles, shared by the translation
// units of the C ABI (api.cpp, draft_api.cpp).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "runtime/context.h"
#include "model/dflash_draft.h"
#include "runtime/drafter.h"
#include "model/qwen35.h"
#include "spec/dflash_proposer.h"
#include "spec/draft_model.h"
#include "spec/generator.h"
#include "spec/hook_proposers.h"
#include "spec/lookup_proposer.h"
#include "spec/mtp_proposer.h"

struct dfl_model {
  std::unique_ptr<dfl::Model> m;
};

struct dfl_draft {
  std::unique_ptr<dfl::DraftModel> d;
};

struct dfl_context {
  std::unique_ptr<dfl::Context> ctx;
  std::unique_ptr<dfl::Generator> gen;
  std::unique_ptr<dfl::Drafter> drafter;  // attached drafter runtime (on ctx's threads)
  std::unique_ptr<dfl::DFlashProposer> dflash;           // ... as the generator sees it
  std::unique_ptr<dfl::DraftModelProposer> draft_model;  // or an attached draft model (its own context)
  std::unique_ptr<dfl::MtpProposer> mtp;                  // the target's own MTP head
  std::unique_ptr<dfl::LookupProposer> lookup;            // prompt lookup (no weights)
  // the C API's hooks (tests, oracles): they draft before any attached drafter
  std::unique_ptr<dfl::Proposer> chain_hook, tree_hook, topk_hook;
  std::unique_ptr<dfl::Constraint> constraint;  // structured output (dfl_context_set_constraint)
  mutable std::string backend_name;        // dfl_context_backend's string
  dfl_context* slot_base = nullptr;        // a slot (dfl_context_new_slot): the context whose backend it shares

  // The attached drafters in the order they were attached: the order of preference (a chain or DDTree step
  // drafts with the first that can; auto ranks them by what they earn).
  std::vector<const void*> attach_order;
  void attached(const void* p) { attach_order.push_back(p); }

  // Hands the generator every attached proposer, most preferred first: the hooks, then the drafters as attached.
  void refresh_proposers() {
    std::vector<dfl::Proposer*> ps{chain_hook.get(), tree_hook.get(), topk_hook.get()};
    std::vector<dfl::Proposer*> attached{draft_model.get(), dflash.get(), mtp.get(), lookup.get()};
    std::vector<const void*> live;
    for (const void* a : attach_order)
      for (dfl::Proposer* p : attached)
        if (p && p == a) ps.push_back(p), live.push_back(a);
    attach_order = live;  // detached ones leave the order
    gen->set_proposers(ps);
  }
};

struct dfl_drafter {
  std::unique_ptr<dfl::Drafter> r;
};

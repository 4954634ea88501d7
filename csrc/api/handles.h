// handles.h — the definitions of the C handles, shared by the translation
// units of the C ABI (api.cpp, draft_api.cpp).
#pragma once
#include <memory>
#include <string>

#include "model/context.h"
#include "model/dflash_draft.h"
#include "model/drafter.h"
#include "model/qwen35.h"
#include "spec/generator.h"
#include "spec/draft_model.h"

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
  std::unique_ptr<dfl::DraftModelProposer> draft_model;  // or an attached draft model (its own context)
  mutable std::string backend_name;        // dfl_context_backend's string
};

struct dfl_drafter {
  std::unique_ptr<dfl::Drafter> r;
};

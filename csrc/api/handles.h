// handles.h — the definition of the dfl_model handle, shared by the C entry
// points outside api.cpp that take a model (csrc/api/draft_api.cpp).
#pragma once
#include <memory>

#include "model/qwen35.h"

struct dfl_model {
  std::unique_ptr<dfl::Model> m;
};

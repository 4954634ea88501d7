// draft_api.cpp — C entry points for the DFlash drafter (load, info, free).
// Bodies run inside dfl::api_guard, like every entry point in api.cpp.
#include <memory>

#include "api/handles.h"
#include "api/last_error.h"
#include "dflash27b.h"
#include "model/dflash_draft.h"

struct dfl_draft {
  std::unique_ptr<dfl::DraftModel> d;
};

namespace {
constexpr int kMaxInfoLayerIds = 16;  // dfl_draft_info.target_layer_ids
}

#pragma GCC visibility push(default)
extern "C" {

dfl_draft* dfl_draft_load(const char* path, const dfl_model* target) {
  dfl_draft* out = nullptr;
  dfl::api_guard([&] {
    if (!path) dfl::fail("path is NULL");
    auto d = std::make_unique<dfl_draft>();
    d->d = dfl::load_draft(path);
    if ((int)d->d->cfg.target_layer_ids.size() > kMaxInfoLayerIds)
      dfl::fail("%s: %zu target_layer_ids; this build supports at most %d", path,
                d->d->cfg.target_layer_ids.size(), kMaxInfoLayerIds);
    if (target) dfl::validate_pair(d->d->cfg, target->m->cfg);
    out = d.release();
  });
  return out;
}

void dfl_draft_free(dfl_draft* d) { delete d; }

int dfl_draft_get_info(const dfl_draft* d, dfl_draft_info* o) {
  return dfl::api_guard([&] {
    if (!d) dfl::fail("draft is NULL");
    if (!o) dfl::fail("info is NULL");
    const dfl::DraftConfig& c = d->d->cfg;
    *o = dfl_draft_info{};
    o->n_layer = c.n_layer; o->hidden = c.hidden; o->n_head = c.n_head; o->n_head_kv = c.n_head_kv;
    o->head_dim = c.head_dim; o->n_ff = c.n_ff; o->n_vocab = c.n_vocab;
    o->block_size = c.block_size; o->mask_token_id = c.mask_token_id;
    o->n_target_layers = (int32_t)c.target_layer_ids.size();
    for (int i = 0; i < o->n_target_layers; ++i) o->target_layer_ids[i] = c.target_layer_ids[(size_t)i];
    for (uint8_t s : c.is_sliding) o->n_sliding_layers += s;
    o->sliding_window = c.sliding_window;
    o->rms_eps = c.rms_eps; o->rope_theta = (float)c.rope_theta;
    o->weight_bytes = d->d->weight_bytes;
  });
}

}  // extern "C"
#pragma GCC visibility pop

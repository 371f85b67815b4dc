// A CPU-only program using triattn through its public API: append tokens, compact, check data.
#include <triattn/triattn.hpp>

#include <cstdio>
#include <vector>

int main() {
  triattn::CacheConfig cfg;
  cfg.model = {/*layers*/ 2, /*q heads*/ 4, /*kv heads*/ 2, /*head_dim*/ 8};
  cfg.block_size = 4;
  cfg.num_blocks = 32;
  cfg.max_seqs = 2;
  cfg.dtype = triattn::DType::kF32;
  triattn::KvCache<> cache(cfg);
  const triattn::SeqId seq = cache.add_sequence();
  const int n = 10, per_layer = n * 2 * 8;
  std::vector<float> k(2 * per_layer), v(2 * per_layer);
  for (int i = 0; i < 2 * per_layer; ++i) { k[i] = float(i); v[i] = float(-i); }
  if (!cache.append<float>(seq, k, v, n, triattn::Phase::kPrefill).ok()) return 1;
  triattn::KeepPlan plan(2, 2, 3);  // keep tokens 1, 4, 9 of every (layer, head)
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 2; ++h) { auto* r = plan.row(l, h); r[0] = 1; r[1] = 4; r[2] = 9; }
  cache.apply_keep_plan(seq, plan);
  const auto view = cache.view<float>();
  // slot 1 of (layer 1, K, head 1) must now hold token 4's vector: [layer][token][head][dim]
  const float got = view.token(1, triattn::KvKind::kKey, seq, 1, 1)[0];
  const float want = float(1 * per_layer + (4 * 2 + 1) * 8);
  const auto mem = cache.memory();
  std::printf("consumer_cpu: length %d, logical %lld, blocks used %zu, slot value %.0f (want %.0f)\n",
              cache.physical_length(seq), static_cast<long long>(cache.logical_position(seq)), mem.blocks_used, got, want);
  return (got == want && cache.physical_length(seq) == 3 && cache.logical_position(seq) == 10 && mem.blocks_used == 1) ? 0 : 1;
}

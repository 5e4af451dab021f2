// Stand-in for Gloo's rendezvous store: see README.md in this folder.
// Declares exactly the virtual methods that c10d's inline `GlooStore` overrides (without
// GLOO_STORE_HAS_STORE_V2); the shim never instantiates `GlooStore`.
#pragma once
#include <chrono>
#include <string>
#include <vector>
#include <gloo/stub_decls.h>
namespace gloo {
namespace rendezvous {
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<char>& data) = 0;
  virtual std::vector<char> get(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual void wait(
      const std::vector<std::string>& keys,
      const std::chrono::milliseconds& timeout) = 0;
};
} // namespace rendezvous
} // namespace gloo

// Declarations shared by the Gloo stand-in headers: see README.md in this folder.
// Only names and the one member function c10d's inline code mentions; no layout is assumed,
// because the shim never creates or touches a Gloo object.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>
namespace gloo {
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
  Context() = delete;
};
namespace transport {
class Device;
class UnboundBuffer;
} // namespace transport
} // namespace gloo
